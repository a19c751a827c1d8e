"""A night trained by several processes: who trains (the world, the launch command; torch-free for the
daemon) and the collectives between the ranks."""
