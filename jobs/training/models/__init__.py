"""Stand-ins to measure and test with: real architectures built random-initialised into a local directory,
the embedded tiny demo model, and synthetic samples with the published length profiles."""
