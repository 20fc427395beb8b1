"""`dflash bench` as a library: plain decoding vs DFlash (and prompt lookup) on the same prompts.

    samples = load_dataset("humaneval", max_samples=20, seed=0)
    result = run_bench(engine, samples, BenchSettings(dataset="humaneval"), results_log=ResultsLog(path))
    doc = build_document(result)          # the JSON document CI reads
    check_lossless(doc); check_floors(doc, min_speedup=2.0)

Rich rendering lives in dflash_cli.bench.report (imported separately: it pulls in rich).
"""

from dflash_cli.bench.datasets import Sample, load_dataset
from dflash_cli.bench.document import SCHEMA_VERSION, build_document, build_sweep_document
from dflash_cli.bench.gates import check_floors, check_lossless
from dflash_cli.bench.results_log import ResultsLog, default_results_path
from dflash_cli.bench.runner import BenchProgress, BenchResult, BenchSettings, run_bench

__all__ = [
    "SCHEMA_VERSION",
    "BenchProgress",
    "BenchResult",
    "BenchSettings",
    "ResultsLog",
    "Sample",
    "build_document",
    "build_sweep_document",
    "check_floors",
    "check_lossless",
    "default_results_path",
    "load_dataset",
    "run_bench",
]
