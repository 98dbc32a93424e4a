"""Hostile command lines for every kvlab command: exit 2, one line on stderr, no traceback, nothing
written, and within a deadline.

The table rebuilds the audit of issue 27 (item 11): wrong types, negative, zero, NaN/inf and huge
numbers, empty strings, missing files, folders, FIFOs, ``/dev/zero`` and a 12 GB sparse file as text
inputs, unwritable outputs under /proc, deep TOML and JSON, absurd model configs, malformed and silent
Ray addresses. Together with ``tests/test_cli_errors.py`` it holds more than 184 cases. Every case
fails before a model loads; they run in a small thread pool (``tests/cli_runner.py``), each in its own
empty folder, each killed at ``CASE_TIMEOUT_S`` (a hang fails its test instead of stalling the suite).
(``kvlab serve`` and the store's own files are covered by their own tables; ``store put -T`` reads its
text through the shared reader and is here.)
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from tests.cli_runner import REPO, Runner, assert_one_line_exit_2, selected_params

LLAMA = json.loads(
    (REPO / "tests" / "fixtures" / "model-configs" / "tinyllama-1.1b-chat-v1.0.json").read_text()
)
GEMMA = json.loads(
    (REPO / "tests" / "fixtures" / "model-configs" / "gemma-3-tiny-hybrid-rope.json").read_text()
)
SPARSE_BYTES = 12 * 10**9  # a 12 GB text file that costs no disk (os.truncate makes it sparse)
LONG_SYSTEM = "word " * 2000  # a 2,000-token system prompt

# Model configs (CFG_*, written as JSON) for `inspect --config` and tiny sweep models.
CONFIGS = {
    "CFG_LAYERS_1E12": {**LLAMA, "num_hidden_layers": 10**12},
    "CFG_LAYERS_FLOAT": {**LLAMA, "num_hidden_layers": 1e12},
    "CFG_LAYERS_5000": {**LLAMA, "num_hidden_layers": 5000},
    "CFG_HIDDEN_HUGE": {**LLAMA, "hidden_size": 2**40},
    "CFG_HEADS_HUGE": {**LLAMA, "num_attention_heads": 10**9},
    "CFG_KV_HEADS_HUGE": {**LLAMA, "num_key_value_heads": 10**9},
    "CFG_VOCAB_HUGE": {**LLAMA, "vocab_size": 10**12},
    "CFG_HEAD_DIM_HUGE": {**LLAMA, "head_dim": 10**8},
    "CFG_INTER_HUGE": {**LLAMA, "intermediate_size": 10**15},
    "CFG_POSITIONS_HUGE": {**LLAMA, "max_position_embeddings": 10**30},
    "CFG_NESTED_HUGE": {
        **GEMMA,
        "text_config": {**GEMMA.get("text_config", {}), "num_hidden_layers": 10**12},
    },
    "CFG_ZERO_HEADS": {**LLAMA, "num_attention_heads": 0},
    "CFG_LAYERS_STR": {**LLAMA, "num_hidden_layers": "many"},
    "CFG_HEADS_INDIVISIBLE": {**LLAMA, "num_key_value_heads": 5},
    "CFG_NO_TYPE": {k: v for k, v in LLAMA.items() if k != "model_type"},
    "CFG_UNKNOWN_TYPE": {**LLAMA, "model_type": "no-such-architecture"},
    "CFG_T5": {"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 100},
}

GRID_HEAD = 'profile = "quick"\nmodels = ["smollm2-135m"]\n'
INSPECT = '\n[[experiments]]\nname = "inspect"\n'


def _exp(name: str, options: str) -> str:
    return f'\n[[experiments]]\nname = "{name}"\noptions = {{ {options} }}\n'


# Grid files (GRID_*): {FILE-like placeholders} are filled in with the fixture's paths.
GRIDS = {
    "GRID_OK": GRID_HEAD + INSPECT,
    "GRID_DEEP": GRID_HEAD + "seeds = " + "[" * 5000 + "]" * 5000 + "\n" + INSPECT,
    "GRID_DEEP_OPTION": GRID_HEAD + _exp("inspect", "prompts = " + "[" * 3000 + "]" * 3000),
    "GRID_SEED_1E23": GRID_HEAD + "seeds = [100000000000000000000000]\n" + INSPECT,
    "GRID_SEED_2_32": GRID_HEAD + "seeds = [4294967296]\n" + INSPECT,
    "GRID_SEED_NEG": GRID_HEAD + "seeds = [-1]\n" + INSPECT,
    "GRID_SEED_FLOAT": GRID_HEAD + "seeds = [0.5]\n" + INSPECT,
    "GRID_SEED_EMPTY": GRID_HEAD + "seeds = []\n" + INSPECT,
    "GRID_TEXT_HUGE": GRID_HEAD + 'texts = ["{HUGE}"]\n' + INSPECT,
    "GRID_TEXT_FIFO": GRID_HEAD + 'texts = ["{FIFO}"]\n' + INSPECT,
    "GRID_TEXT_DEVZERO": GRID_HEAD + 'texts = ["/dev/zero"]\n' + INSPECT,
    "GRID_TEXT_DIR": GRID_HEAD + 'texts = ["{DIR}"]\n' + INSPECT,
    "GRID_TEXT_LATIN1": GRID_HEAD + 'texts = ["{LATIN1}"]\n' + INSPECT,
    "GRID_TEXT_EMPTY": GRID_HEAD + 'texts = ["{EMPTY}"]\n' + INSPECT,
    "GRID_TEXT_NOT_LIST": GRID_HEAD + 'texts = "{FILE}"\n' + INSPECT,
    "GRID_OPT_TYPE": GRID_HEAD + _exp("transfer_equivalence", 'pairs = "abc"'),
    "GRID_OPT_NEG": GRID_HEAD + _exp("transfer_equivalence", "pairs = -3"),
    "GRID_OPT_ZERO": GRID_HEAD + _exp("transfer_equivalence", "pairs = 0"),
    "GRID_OPT_FLOAT_FOR_INT": GRID_HEAD + _exp("transfer_equivalence", "a_tokens = 2.5"),
    "GRID_OPT_BOOL_FOR_INT": GRID_HEAD + _exp("transfer_equivalence", "pairs = true"),
    "GRID_OPT_HUGE": GRID_HEAD + _exp("streaming_ppl", "tokens = 1000000000"),
    "GRID_OPT_NAN": GRID_HEAD + _exp("transplant", "alpha = nan"),
    "GRID_OPT_INF": GRID_HEAD + _exp("transplant", "alpha = inf"),
    "GRID_OPT_FLOAT_NEG": GRID_HEAD + _exp("transplant", "alpha = -1.0"),
    "GRID_OPT_LIST_ITEM": GRID_HEAD + _exp("streaming_ppl", "windows = [128, -1]"),
    "GRID_OPT_LIST_EMPTY": GRID_HEAD + _exp("streaming_ppl", "windows = []"),
    "GRID_OPT_NOT_BOOL": GRID_HEAD + _exp("streaming_ppl", 'loop = "yes"'),
    "GRID_OPT_EMPTY_STR": GRID_HEAD + _exp("transplant", 'target_model = ""'),
    "GRID_OPT_TEXT_FIFO": GRID_HEAD + _exp("roll_sweep", 'text = "{FIFO}"'),
    "GRID_OPT_TEXT_HUGE": GRID_HEAD + _exp("suffix_caching", 'text_file = "{HUGE}"'),
    "GRID_OPT_CONFIG_HUGE": GRID_HEAD + _exp("inspect", 'config = "{CFG_LAYERS_1E12}"'),
    "GRID_OPT_CONVERSATIONS_DEEP": GRID_HEAD + _exp("compaction", 'conversations = "{DEEP_JSON}"'),
    "GRID_OPT_CONVERSATIONS_OBJECT": GRID_HEAD + _exp("compaction", 'conversations = "{JSON_OBJECT}"'),
    "GRID_OPT_TABLE": GRID_HEAD + _exp("transfer_equivalence", "pairs = { n = 2 }"),
    "GRID_TINY_HUGE": 'profile = "quick"\nmodels = ["tiny:{CFG_LAYERS_1E12}"]\n' + INSPECT,
    "GRID_TINY_DIR": 'profile = "quick"\nmodels = ["tiny:{DIR}"]\n' + INSPECT,
    "GRID_MODELS_EMPTY": 'profile = "quick"\nmodels = []\n' + INSPECT,
    "GRID_MODELS_BLANK": 'profile = "quick"\nmodels = ["  "]\n' + INSPECT,
    "GRID_TOO_MANY_CELLS": GRID_HEAD + "seeds = [" + ", ".join(map(str, range(20000))) + "]\n" + INSPECT,
    "GRID_UNKNOWN_KEY": GRID_HEAD + "parallel = 4\n" + INSPECT,
    "GRID_PROFILE": 'profile = "fast"\nmodels = ["smollm2-135m"]\n' + INSPECT,
    "GRID_GPUS_HUGE": GRID_HEAD + "gpus_per_actor = 1e9\n" + INSPECT,
    "GRID_GPUS_NAN": GRID_HEAD + "gpus_per_actor = nan\n" + INSPECT,
    "GRID_DEVICE_INT": GRID_HEAD + "device = 0\n" + INSPECT,
    "GRID_NO_EXPERIMENTS": GRID_HEAD,
    "GRID_EXPERIMENT_NO_NAME": GRID_HEAD + "\n[[experiments]]\noptions = {}\n",
}

# (argv, a fragment the one error line must contain). Placeholders: FILE (a small text file), LATIN1,
# EMPTY, BIN (not UTF-8), HUGE (a 12 GB sparse file), FIFO, DIR, DEEP_JSON, JSON_OBJECT, LONG_SYSTEM,
# FREE_PORT (127.0.0.1:<nothing listening>), and the CFG_* and GRID_* files above. Relative paths such
# as `out` are inside the case's own empty folder, which must stay empty.
PROC = "/proc/kvlab-cannot-be-here"
CASES = [
    # -- inspect --------------------------------------------------------------------------------------
    (["inspect", "--config", "CFG_LAYERS_1E12"], "num_hidden_layers is 1,000,000,000,000"),
    (["inspect", "--config", "CFG_LAYERS_FLOAT"], "num_hidden_layers is 1e+12"),
    (["inspect", "--config", "CFG_LAYERS_5000"], "num_hidden_layers is 5,000, more than 4,096"),
    (["inspect", "--config", "CFG_HIDDEN_HUGE"], "hidden_size is"),
    (["inspect", "--config", "CFG_HEADS_HUGE"], "num_attention_heads is"),
    (["inspect", "--config", "CFG_KV_HEADS_HUGE"], "num_key_value_heads is"),
    (["inspect", "--config", "CFG_VOCAB_HUGE"], "vocab_size is"),
    (["inspect", "--config", "CFG_HEAD_DIM_HUGE"], "head_dim is"),
    (["inspect", "--config", "CFG_INTER_HUGE"], "intermediate_size is"),
    (["inspect", "--config", "CFG_POSITIONS_HUGE"], "max_position_embeddings is"),
    (["inspect", "--config", "CFG_NESTED_HUGE"], "text_config.num_hidden_layers is"),
    (["inspect", "--config", "CFG_ZERO_HEADS"], "num_attention_heads must be an integer >= 1"),
    (["inspect", "--config", "CFG_LAYERS_STR"], "--config"),
    (["inspect", "--config", "CFG_HEADS_INDIVISIBLE"], "not a multiple"),
    (["inspect", "--config", "CFG_NO_TYPE"], "no 'model_type'"),
    (["inspect", "--config", "CFG_UNKNOWN_TYPE"], "cannot build"),
    (["inspect", "--config", "CFG_T5"], "encoder-decoder"),
    (["inspect", "--config", "DEEP_JSON"], "nested too deeply"),
    (["inspect", "--config", "JSON_LIST"], "not an object"),
    (["inspect", "--config", "FIFO"], "it is a FIFO"),
    (["inspect", "--config", "DIR"], "it is a folder"),
    (["inspect", "--config", "/dev/zero"], "it is a device"),
    (["inspect", "--config", "HUGE"], "over the 16.0 MiB limit"),
    (["inspect", "--config", "EMPTY"], "not a JSON config file"),
    (["inspect", "--config", ""], "--config"),
    (["inspect", "--dtype", ""], "empty dtype"),
    (["inspect", "--dtype", " "], "empty dtype"),
    (["inspect", "--dtype", "float7"], "float7"),
    (["inspect", "--dtype", "int8"], "sizes a cache from --config only"),
    (["inspect", "--model", ""], "empty model name"),
    (["inspect", "--model", "   "], "empty model name"),
    (["inspect", "--device", "gpu"], "unknown device 'gpu'"),
    (["inspect", "--device", ""], "--device"),
    (["inspect", "--prompt", ""], "empty prompt"),
    (["inspect", "--out", PROC], "cannot create folders"),
    (["inspect", "--out", "FIFO"], "is not a folder"),
    (["inspect", "--out", "/dev/null"], "is not a folder"),
    (["inspect", "--quick", "yes"], "unexpected extra argument"),
    # -- study, experiments -----------------------------------------------------------------------------
    (["study", "--seed", "-1"], "--seed"),
    (["study", "--seed", "4294967296"], "--seed"),
    (["study", "--seed", "100000000000000000000000"], "--seed"),
    (["study", "--seed", "1.5"], "valid integer"),
    (["study", "--workers", "0"], "--workers"),
    (["study", "--workers", "100000"], "--workers"),
    (["study", "--only", ""], "unknown experiment"),
    (["study", "--out", PROC], "cannot create folders"),
    (["study", "--out", "/dev/null"], "is not a folder"),
    (["study", "--model", ""], "empty model name"),
    (["study", "--dtype", "int4"], "int4"),
    (["experiments", "extra"], "unexpected extra argument"),
    (["experiments", "--json"], "No such option"),
    # -- roll ---------------------------------------------------------------------------------------------
    (["roll", "sweep", "-T", "HUGE"], "over the 64.0 MiB limit"),
    (["roll", "sweep", "-T", "FIFO"], "it is a FIFO"),
    (["roll", "long", "-T", "/dev/zero"], "it is a device"),
    (["roll", "sweep", "-T", "/proc/self/environ"], "kernel pseudo-file"),  # the environment holds keys
    (["roll", "sweep", "-T", "/sys/kernel/mm/transparent_hugepage/enabled"], "kernel pseudo-file"),
    (["roll", "derotation", "-T", "DIR"], "it is a folder"),
    (["roll", "findings", "-T", "BIN"], "not UTF-8"),
    (["roll", "sweep", "-T", ""], "--text"),
    (["roll", "sweep", "-c", "1"], "--context"),
    (["roll", "long", "-c", "1000000000000"], "--context"),
    (["roll", "derotation", "-c", "nan"], "valid integer"),
    (["roll", "sweep", "--seed", "-7"], "--seed"),
    (["roll", "long", "--seed", "100000000000000000000000"], "--seed"),
    (["roll", "sweep", "--out", PROC], "cannot create folders"),
    (["roll", "findings", "--out", "FILE"], "is a file"),
    (["roll", "sweep", "--device", "tpu"], "unknown device"),
    # -- attention, compaction --------------------------------------------------------------------------
    (["attention", "-r", "1000000000"], "--roll"),
    (["attention", "--samples", "1"], "--samples"),
    (["attention", "-c", "4"], "--context"),
    (["attention", "-T", "HUGE"], "over the 64.0 MiB limit"),
    (["attention", "-T", "FIFO"], "it is a FIFO"),
    (["attention", "--out", PROC], "cannot create folders"),
    (["compaction", "--conversations", "FIFO"], "it is a FIFO"),
    (["compaction", "--conversations", "DEEP_JSON"], "nested too deeply"),
    (["compaction", "--conversations", "FILE"], "is not JSON"),
    (["compaction", "--conversations", "JSON_OBJECT"], "JSON list"),
    (["compaction", "--conversations", "HUGE"], "over the 64.0 MiB limit"),
    (["compaction", "--conversations", "/nonexistent.json"], "is not a file"),
    (["compaction", "--limit", "1000000000"], "--limit"),
    # -- compress, train-evictor ------------------------------------------------------------------------
    (["compress", "--bits", "5"], "unsupported bit width 5"),
    (["compress", "--bits", "17"], "--bits"),
    (["compress", "--keep", "0"], "(0, 1]"),
    (["compress", "--keep", "-0.5"], "(0, 1]"),
    (["compress", "--keep", "inf"], "not a finite number"),
    (["compress", "--method", "zip"], "unknown quantizer"),
    (["compress", "--policy", "lru"], "unknown policy"),
    (["compress", "--samples", "0"], "--samples"),
    (["compress", "-c", "1"], "--context"),
    (["compress", "-T", "HUGE"], "over the 64.0 MiB limit"),
    (["compress", "-T", "/dev/zero"], "it is a device"),
    (["compress", "--seed", "-5"], "--seed"),
    (["train-evictor", "--weights", "/proc/x/y"], "cannot write there"),
    (["train-evictor", "--weights", PROC + "/w.json"], "cannot write there"),
    (["train-evictor", "--weights", "DIR"], "is a folder"),
    (["train-evictor", "--weights", "FIFO"], "not a regular file"),
    (["train-evictor", "--samples", "3"], "--samples"),
    (["train-evictor", "--context", "1"], "--context"),
    (["train-evictor", "--future", "0"], "--future"),
    (["train-evictor", "--steps", "1000000000"], "--steps"),
    (["train-evictor", "-T", "HUGE"], "over the 64.0 MiB limit"),
    (["train-evictor", "-T", "FIFO"], "it is a FIFO"),
    (["train-evictor", "--model", ""], "empty model name"),
    (["train-evictor", "--seed", "1099511627776"], "--seed"),
    # -- eval ruler (issue 31) ----------------------------------------------------------------------------
    (["eval", "ruler", "--cache", "bogus"], "cache spec 'bogus': unknown item 'bogus'"),
    (["eval", "ruler", "--cache", "h2o:2"], "must lie in [0, 1)"),
    (["eval", "ruler", "--cache", "h2o:abc"], "ratio=abc is not a number"),
    (["eval", "ruler", "--cache", "int9"], "unsupported bit width 9"),
    (["eval", "ruler", "--cache"], "requires an argument"),
    (["eval", "ruler", "--lengths", "abc"], "comma-separated list"),
    (["eval", "ruler", "--lengths", "0"], "outside [128, 1048576]"),
    (["eval", "ruler", "--lengths", "100000000"], "outside [128, 1048576]"),
    (["eval", "ruler", "--tasks", "nope"], "unknown task(s) 'nope'"),
    (["eval", "ruler", "--trials", "0"], "--trials"),
    (["eval", "ruler", "--haystack", "/nonexistent.txt"], "is not a file"),
    (["eval", "ruler", "--haystack", "FIFO"], "it is a FIFO"),
    (["eval", "ruler", "--haystack", "DIR"], "it is a folder"),
    (["eval", "ruler", "--haystack", "HUGE"], "over the 64.0 MiB limit"),
    (["eval", "ruler", "--haystack", "/dev/zero"], "it is a device"),
    (["eval", "ruler", "-n", "0"], "--max-new-tokens"),
    (["eval", "ruler", "--out", PROC], "cannot create folders"),
    (["eval", "ruler", "--device", "tpu"], "unknown device 'tpu'"),
    (["eval", "ruler", "--dtype", ""], "unknown dtype"),
    (["eval", "ruler", "--seed", "-1"], "--seed"),
    (["eval", "ruler", "--model", ""], "empty model name"),
    # -- stream-ppl, suffix -------------------------------------------------------------------------------
    (["stream-ppl", "--tokens", "1000000000"], "--tokens"),
    (["stream-ppl", "--tokens", "1"], "--tokens"),
    (["stream-ppl", "--sinks", "3"], "1, 2, 4, 8"),
    (["stream-ppl", "--window", "1000000000"], "--window"),
    (["stream-ppl", "--recompute-samples", "0"], "--recompute-samples"),
    (["stream-ppl", "--stride", "0"], "--stride"),
    (["stream-ppl", "--cache", "h2o,keep=0.5,every=x"], "not an integer"),
    (["stream-ppl", "-T", "HUGE"], "over the 64.0 MiB limit"),
    (["stream-ppl", "-T", "FIFO"], "it is a FIFO"),
    (["stream-ppl", "-T", "DIR"], "it is a folder"),
    (["stream-ppl", "--out", PROC], "cannot create folders"),
    (["suffix", "--roll", "0%"], "between 0% and 100%"),
    (["suffix", "--roll", "-5"], "at least one token"),
    (["suffix", "--roll", ""], "neither a token count nor a share"),
    (["suffix", "--roll", "nan%"], "between 0% and 100%"),
    (["suffix", "--sinks", "-1"], "--sinks"),
    (["suffix", "--samples", "0"], "--samples"),
    (["suffix", "-c", "1000000000"], "--context"),
    (["suffix", "-T", "FIFO"], "it is a FIFO"),
    (["suffix", "-T", "/dev/zero"], "it is a device"),
    (["suffix", "-T", "HUGE"], "over the 64.0 MiB limit"),
    # -- generate, chat -----------------------------------------------------------------------------------
    (["generate", ""], "empty prompt"),
    (["generate", "hi", "-w", "16", "-s", "16"], "must be fewer than --window"),
    (["generate", "hi", "-w", "100000"], "maximum position"),
    (["generate", "hi", "-w", "1000000000"], "--window"),
    (["generate", "hi", "-t", "1e400"], "not a finite number"),
    (["generate", "hi", "--capture", "jit"], "--capture"),
    (["generate", "hi", "--capture", "cuda-graph", "--device", "cpu"], "needs a CUDA device"),
    (["generate", "hi", "--evict-chunk", "0"], "--evict-chunk"),
    (["generate", "hi", "-n", "1000000000"], "--max-new-tokens"),
    (["generate", "hi", "--seed", "-1"], "--seed"),
    (["generate", "hi", "--model", ""], "empty model name"),
    (["generate", "hi", "--dtype", "float7"], "float7"),
    (["generate", "hi", "--cache", "sinks=4,window=0"], "window must be >= 1"),
    (["generate", "hi", "--cache", "sinks=4,window=64", "-w", "64"], "drop --window"),
    (["chat", "-w", "16", "--system", "LONG_SYSTEM"], "the system prompt takes"),
    (["chat", "-w", "4", "-s", "4"], "must be fewer than --window"),
    (["chat", "-w", "100000"], "maximum position"),
    (["chat", "-n", "1000000000"], "--max-new-tokens"),
    (["chat", "--evict-chunk", "0"], "--evict-chunk"),
    (["chat", "-w", "0"], "--window"),
    (["chat", "--model", ""], "empty model name"),
    (["chat", "--device", "gpu"], "unknown device"),
    # -- model-path ---------------------------------------------------------------------------------------
    (["model-path", "--model", ""], "empty model name"),
    (["model-path", "--model", "DIR"], "has no config.json"),
    (["model-path", "--model", "FIFO"], "has no config.json"),
    (["model-path", "--model", "no-such-org/no-such-model"], "never downloads"),
    # -- transfer -----------------------------------------------------------------------------------------
    (["transfer", "equivalence", "--pairs", "0"], "--pairs"),
    (["transfer", "equivalence", "--pairs", "1000000000"], "--pairs"),
    (["transfer", "retention", "--facts", "35"], "--facts"),
    (["transfer", "retention", "--sinks", "-1"], "--sinks"),
    (["transfer", "layers", "--facts", "99"], "--facts"),
    (["transfer", "layers", "--width", "0"], "--width"),
    (["transfer", "layers", "--stride", "0"], "--stride"),
    (["transfer", "kv-swap", "--samples", "0"], "--samples"),
    (["transfer", "kv-swap", "--roll", "1000000000"], "--roll"),
    (["transfer", "transplant", "--cross-texts", "-1"], "--cross-texts"),
    (["transfer", "transplant", "--cross-texts", "0"], "--cross-texts"),
    (["transfer", "transplant", "--target-model", ""], "empty model name"),
    (["transfer", "numerics", "--steps", "1"], "--steps"),
    (["transfer", "numerics", "--steps", "x"], "valid integer"),
    (["transfer", "finetune-derivative", "-T", "HUGE"], "over the 64.0 MiB limit"),
    (["transfer", "finetune-derivative", "-T", "FIFO"], "it is a FIFO"),
    (["transfer", "finetune-derivative", "--steps", "0"], "--steps"),
    (["transfer", "finetune-derivative", "--seq-len", "1"], "--seq-len"),
    (["transfer", "finetune-derivative", "--batch", "0"], "--batch"),
    (["transfer", "finetune-derivative", "--lr", "nan"], "--lr"),
    (["transfer", "finetune-derivative", "--lr", "-1"], "--lr"),
    (["transfer", "finetune-derivative", "--name", "../evil"], "plain name"),
    (["transfer", "finetune-derivative", "--seed", "-1"], "--seed"),
    # -- sweep: the command line --------------------------------------------------------------------------
    (["sweep", "GRID_OK", "-o", "/proc/x"], "cannot create folders"),
    (["sweep", "GRID_OK", "-o", "FILE"], "is a file"),
    (["sweep", "GRID_OK", "--ray", "256.0.0.1:1"], "256.0.0.1 is not an IP address"),
    (["sweep", "GRID_OK", "--ray", "head-node"], "host:port"),
    (["sweep", "GRID_OK", "--ray", "127.0.0.1:99999"], "not in 1-65535"),
    (["sweep", "GRID_OK", "--ray", "http://127.0.0.1:8265"], "host:port"),
    (["sweep", "GRID_OK", "--ray", ""], "host:port"),
    (["sweep", "GRID_OK", "--ray", "FREE_PORT"], "cannot connect to the Ray cluster"),
    (["sweep", "GRID_OK", "--ray", "192.0.2.1:6379"], "cannot connect to the Ray cluster"),
    (["sweep", "GRID_OK", "--workers", "0"], "--workers"),
    (["sweep", "GRID_OK", "--workers", "1000000"], "--workers"),
    (["sweep", "GRID_OK", "--device", "gpu"], "unknown device"),
    (["sweep", "GRID_OK", "--dtype", "float7"], "float7"),
    (["sweep", "FIFO"], "it is a FIFO"),
    (["sweep", "/dev/zero"], "it is a device"),
    (["sweep", "DIR"], "it is a folder"),
    (["sweep", "HUGE"], "over the 1.0 MiB limit"),
    (["sweep", "LATIN1"], "not UTF-8"),
    (["sweep", "EMPTY"], "is empty"),
    (["sweep", "/nonexistent/grid.toml"], "no grid file"),
    # -- sweep: the grid ----------------------------------------------------------------------------------
    (["sweep", "GRID_DEEP"], "nested too deeply"),
    (["sweep", "GRID_DEEP_OPTION"], "nested too deeply"),
    (["sweep", "GRID_SEED_1E23"], "'seeds' must be"),
    (["sweep", "GRID_SEED_2_32"], "'seeds' must be"),
    (["sweep", "GRID_SEED_NEG"], "'seeds' must be"),
    (["sweep", "GRID_SEED_FLOAT"], "'seeds' must be"),
    (["sweep", "GRID_SEED_EMPTY"], "'seeds' must be"),
    (["sweep", "GRID_TEXT_HUGE"], "over the 64.0 MiB limit"),
    (["sweep", "GRID_TEXT_FIFO"], "it is a FIFO"),
    (["sweep", "GRID_TEXT_DEVZERO"], "it is a device"),
    (["sweep", "GRID_TEXT_DIR"], "it is a folder"),
    (["sweep", "GRID_TEXT_LATIN1"], "not UTF-8"),
    (["sweep", "GRID_TEXT_EMPTY"], "is empty"),
    (["sweep", "GRID_TEXT_NOT_LIST"], "'texts' must be"),
    (["sweep", "GRID_OPT_TYPE"], "option pairs = 'abc' must be an integer"),
    (["sweep", "GRID_OPT_NEG"], "option pairs = -3 must be an integer from 1"),
    (["sweep", "GRID_OPT_ZERO"], "option pairs = 0 must be"),
    (["sweep", "GRID_OPT_FLOAT_FOR_INT"], "option a_tokens = 2.5"),
    (["sweep", "GRID_OPT_BOOL_FOR_INT"], "option pairs = True"),
    (["sweep", "GRID_OPT_HUGE"], "option tokens = 1000000000"),
    (["sweep", "GRID_OPT_NAN"], "option alpha = nan must be a finite number"),
    (["sweep", "GRID_OPT_INF"], "option alpha = inf"),
    (["sweep", "GRID_OPT_FLOAT_NEG"], "option alpha = -1.0"),
    (["sweep", "GRID_OPT_LIST_ITEM"], "option windows = [128, -1]"),
    (["sweep", "GRID_OPT_LIST_EMPTY"], "option windows = []"),
    (["sweep", "GRID_OPT_NOT_BOOL"], "must be true or false"),
    (["sweep", "GRID_OPT_EMPTY_STR"], "option target_model = ''"),
    (["sweep", "GRID_OPT_TEXT_FIFO"], "it is a FIFO"),
    (["sweep", "GRID_OPT_TEXT_HUGE"], "over the 64.0 MiB limit"),
    (["sweep", "GRID_OPT_CONFIG_HUGE"], "num_hidden_layers is"),
    (["sweep", "GRID_OPT_CONVERSATIONS_DEEP"], "option conversations:"),
    (["sweep", "GRID_OPT_CONVERSATIONS_OBJECT"], "must hold a JSON list of objects"),
    (["sweep", "GRID_OPT_TABLE"], "option pairs = {'n': 2}"),
    (["sweep", "GRID_TINY_HUGE"], "num_hidden_layers is"),
    (["sweep", "GRID_TINY_DIR"], "it is a folder"),
    (["sweep", "GRID_MODELS_EMPTY"], "'models' must be"),
    (["sweep", "GRID_MODELS_BLANK"], "'models' must be"),
    (["sweep", "GRID_TOO_MANY_CELLS"], "20,000 cells"),
    (["sweep", "GRID_UNKNOWN_KEY"], "unknown key(s) parallel"),
    (["sweep", "GRID_PROFILE"], "'profile' must be"),
    (["sweep", "GRID_GPUS_HUGE"], "'gpus_per_actor' must be"),
    (["sweep", "GRID_GPUS_NAN"], "'gpus_per_actor' must be"),
    (["sweep", "GRID_DEVICE_INT"], "'device' must be a string"),
    (["sweep", "GRID_NO_EXPERIMENTS"], "at least one [[experiments]]"),
    (["sweep", "GRID_EXPERIMENT_NO_NAME"], "needs name"),
    # -- probe (an HTTP client: refused before any request) ---------------------------------------------------
    (["probe", "ftp://x"], "must be http(s)://HOST"),
    (["probe", "notaurl"], "must be http(s)://HOST"),
    (["probe", "http://127.0.0.1:9", "--trials", "2"], "--trials must be 5..500"),
    (["probe", "http://127.0.0.1:9", "--api", "nope"], "--api must be chat or completions"),
    (["probe", "http://127.0.0.1:9", "--tolerance", "-1"], "--tolerance must be a number"),
    # -- gc, store put -T (the text reader is shared) --------------------------------------------------------
    (["gc", "FIFO"], "is not a folder or a file"),
    (["gc", "/dev/zero"], "is not a folder or a file"),
    (["gc", "DIR", "--older-than", "-1"], "--older-than"),
    (["gc", "DIR", "--older-than", "inf"], "--older-than"),
    (["gc", "DIR", "--older-than", "abc"], "valid number"),
    (["store", "put", "-T", "HUGE"], "over the 64.0 MiB limit"),
    (["store", "put", "-T", "FIFO"], "it is a FIFO"),
    (["store", "put", "-T", "DIR"], "it is a folder"),
    (["store", "put", "-T", "/dev/zero"], "it is a device"),
]


def _ids(cases):
    return [" ".join(a)[:90] for a, _ in cases]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-hostile-inputs")
    (root / "file.txt").write_text("a regular file\n")
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    (root / "binary.bin").write_bytes(bytes(range(256)))
    (root / "empty.txt").write_bytes(b"")
    with open(root / "huge.txt", "wb") as f:
        os.truncate(f.fileno(), SPARSE_BYTES)
    os.mkfifo(root / "fifo")
    (root / "folder").mkdir()
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "list.json").write_text("[1, 2]")
    (root / "object.json").write_text('{"full": "a"}')
    files = {
        "FILE": root / "file.txt",
        "LATIN1": root / "latin1.txt",
        "BIN": root / "binary.bin",
        "EMPTY": root / "empty.txt",
        "HUGE": root / "huge.txt",
        "FIFO": root / "fifo",
        "DIR": root / "folder",
        "DEEP_JSON": root / "deep.json",
        "JSON_LIST": root / "list.json",
        "JSON_OBJECT": root / "object.json",
    }
    for key, cfg in CONFIGS.items():
        files[key] = root / f"{key}.json"
        files[key].write_text(json.dumps(cfg))
    names = {k: str(v) for k, v in files.items()}
    for key, body in GRIDS.items():
        for name, path in names.items():
            body = body.replace("{" + name + "}", path)
        files[key] = root / f"{key}.toml"
        files[key].write_text(body)
    with socket.socket() as s:  # a port where nothing listens (closed again at once)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        **{k: str(v) for k, v in files.items()},
        "LONG_SYSTEM": LONG_SYSTEM,
        "FREE_PORT": f"127.0.0.1:{port}",
        "root": str(root),
    }


@pytest.fixture(scope="module")
def runner(request, inputs, tmp_path_factory):
    """Starts every selected case at once (a small thread pool); each test waits for its own."""
    before = sorted(os.listdir(inputs["root"]))
    run = Runner(tmp_path_factory.mktemp("cli-hostile-runs"))
    for argv in selected_params(request, "test_hostile_command_line", "argv"):
        run.submit(" ".join(argv), [inputs.get(a, a) for a in argv])
    yield run
    run.close()
    assert sorted(os.listdir(inputs["root"])) == before  # no input was changed or added to


def test_the_table_covers_every_command():
    import typer.main

    from kvlab.cli import app

    assert len({tuple(a) for a, _ in CASES}) == len(CASES) >= 120
    group = typer.main.get_group(app)
    covered = {tuple(a[:2]) for a, _ in CASES} | {(a[0],) for a, _ in CASES}
    for name, command in group.commands.items():
        if name in ("serve",):  # the server has its own hostile tables (tests/test_serve*.py)
            continue
        subs = getattr(command, "commands", None)
        if subs is None:
            assert (name,) in covered, name
        elif name != "store":  # the store's own commands: tests/test_store_cli.py
            for sub in subs:
                assert (name, sub) in covered, (name, sub)


@pytest.mark.parametrize("argv, fragment", CASES, ids=_ids(CASES))
def test_hostile_command_line(runner, argv, fragment):
    assert_one_line_exit_2(runner.result(" ".join(argv)), fragment)


def test_fifo_and_sparse_file_stay_untouched(inputs):
    path = Path(inputs["HUGE"])
    assert path.stat().st_size == SPARSE_BYTES and path.stat().st_blocks * 512 < 2**20
