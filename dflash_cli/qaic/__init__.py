"""Qualcomm Cloud AI 100 (QAIC) backend: SDK detection, compile commands, bundles, runtime.

Modules, one job each:
  sdk       find the SDK under /opt/qti-aic (or $DFLASH_QAIC_ROOT), versions, devices
  specs     specializations.json, custom_io.yaml and the multi-device partition JSON
  command   the compile options dataclass and the exact qaic-compile command line
  compile   run the compiler for target and draft, keep logs, check for programqpc.bin
  bundle    a self-contained directory + compile.sh to compile on another (QAIC) host
  runtime   a backends.base.Session over the SDK's `qaicrt` Python runtime

Nothing here imports the SDK at import time; only `runtime` needs it, and only when a
session is opened.
"""
