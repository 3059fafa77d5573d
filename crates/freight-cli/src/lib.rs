//! The `freight` command line, as a library so that the Python wheel can expose it too.
