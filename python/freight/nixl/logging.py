"""NIXL's ``logging`` helper: ``get_logger(name)``.

As NIXL's: loggers of the "nixl" family and those asked for by name print INFO and
above to stdout with a timestamp, unless the application configured logging itself;
``NIXL_LOG_LEVEL`` (TRACE, DEBUG, INFO, WARN, ERROR, FATAL) sets the level."""

from __future__ import annotations

import logging as _logging
import os
import sys

_LEVELS = {"TRACE": _logging.DEBUG, "DEBUG": _logging.DEBUG, "INFO": _logging.INFO, "WARN": _logging.WARNING,
           "WARNING": _logging.WARNING, "ERROR": _logging.ERROR, "FATAL": _logging.CRITICAL}


def get_logger(name: str) -> _logging.Logger:
    logger = _logging.getLogger(name)
    if not _logging.getLogger().handlers and not logger.handlers:
        handler = _logging.StreamHandler(sys.stdout)
        handler.setFormatter(_logging.Formatter("%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s",
                                                "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(_LEVELS.get(os.environ.get("NIXL_LOG_LEVEL", "INFO").upper(), _logging.INFO))
    return logger
