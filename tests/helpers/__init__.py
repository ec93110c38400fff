"""Helpers shared by the test modules of several layers: models, stand-ins for
the GPU, assertions and the pipelines the tests compare against."""
