"""hookfit's tooling, outside the loop and the bus: the ``hookfit`` command line
(:mod:`hookfit.tools.cli`), reading run folders back (:mod:`hookfit.tools.runs`), the demo
(:mod:`hookfit.tools.demo`) and the plugin package scaffold (:mod:`hookfit.tools.scaffold`)."""
