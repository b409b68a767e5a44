__version__ = "0.3.0.dev5"
