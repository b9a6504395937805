"""Pipeline plans as data (built, checked, simulated without processes), their memory model, and the executor that runs a stage's ops."""
