"""What a night learns and whether it is kept: the plan (which samples fit the window, with replay
that protects earlier nights), the evaluation of a model on a set of samples, and the gate a
candidate must pass to be promoted."""
