"""What crosses the driver/worker boundary: the configuration, typed commands, step inputs,
sampling parameters, the sleep state and the errors. Both sides import it; it imports neither."""
