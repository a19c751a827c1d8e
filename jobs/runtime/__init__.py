"""How the Python process itself runs: logging set-up shared by the daemon and the child, which modules
compiled without bytecode, the garbage collector paused while many acyclic objects are built."""
