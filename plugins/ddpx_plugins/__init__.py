"""Built-in ddpx plugins, registered through the `ddpx` entry-point group like any third-party plugin."""
