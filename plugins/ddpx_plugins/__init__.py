"""Built-in ddpx plugins. Every run loads them (``ddpx/plugin/builtin.py`` lists them) unless
``plugins.block`` names them; they use the same hooks as a third-party plugin."""
