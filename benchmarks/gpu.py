"""GPU benchmark (issue 29): decode ms/token at Llama-3.1-8B geometry, bf16, batch 1, random weights.

One script, one GPU, a time budget (default 7 minutes): each section runs only if the budget left
covers its estimate, and says "not run (time budget)" otherwise; every result is written as soon as
it exists (``--out``: ``gpu.json`` and ``gpu.md``), so a run cut short keeps what it measured.

* the card (name, memory) and its measured copy bandwidth (a 2 GiB device-to-device copy, bytes read
  plus written), which gives each decode's **bandwidth floor**: the bytes a step must read at least
  (every weight but the input embedding, plus the cache) over that bandwidth;
* decode ms/token at 8,192 and 32,768 tokens: transformers' ``DynamicCache`` eager, ``StaticCache`` +
  ``torch.compile(mode="reduce-overhead")``, kvlab's ``StaticRollingCache`` stepped by
  :class:`~kvlab.hf.graphs.RollingDecoder` under CUDA graphs and under ``torch.compile``, full
  precision and int4 (each with one roll inside the timed steps), with the cache bytes each holds;
* correctness on the card: the captured rolling steps against the same steps run eagerly, and the
  rolling cache's first decode step against ``DynamicCache``'s;
* the roll (64 tokens fed past a full window, one captured forward) against re-prefilling the window;
* a store hit (memory tier, then disk tier) against a prefill of the same 8,192 tokens.

Token ids are random (the weights are random too: speed does not depend on them); the next token is
the argmax of the last logits, kept on the device, so the timed loops never synchronise.

    python benchmarks/gpu.py [--budget 420] [--out DIR]        # on a CUDA machine
    python benchmarks/gpu.py --tiny                            # a CPU smoke run of every section
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from _common import write_results  # noqa: E402

GiB = 2**30
SINKS, CHUNK = 4, 64


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.perf_counter()
        self.cuda = torch.cuda.is_available() and not args.tiny
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.res: dict = {"sections": {}, "skipped": {}, "errors": {}}

    # -- bookkeeping --------------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.t0)

    def section(self, name: str, estimate: float, fn, *a) -> None:
        if self.args.only and name not in self.args.only and name not in ("card", "model"):
            return
        if self.left() < estimate:
            self.res["skipped"][name] = (
                f"not run (time budget: {self.left():.0f} s left, needs ~{estimate:.0f} s)"
            )
            print(f"[skip] {name}", flush=True)
            self.save()
            return
        start = time.perf_counter()
        print(f"[run ] {name} ({self.left():.0f} s left)", flush=True)
        try:
            self.res["sections"][name] = fn(*a)
        except Exception as exc:  # one failing section must not cost the others
            self.res["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            self.res.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
            self.free()
            self.save()

    def save(self) -> None:
        (self.out / "gpu.json").write_text(json.dumps(self.res, indent=1, default=str))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def profile(self, name: str, fn) -> None:
        """The kernels of one call of ``fn`` by device time (``--out``/profile_<name>.txt): where a step goes."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.sync()
        with profile(activities=acts) as prof:
            fn()
            self.sync()
        key = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=25)
        (self.out / f"profile_{name}.txt").write_text(table)

    def timed(self, step, n: int) -> float:
        """ms per call of ``step()`` over ``n`` calls (synchronised once at each end)."""
        self.sync()
        t = time.perf_counter()
        for _ in range(n):
            step()
        self.sync()
        return (time.perf_counter() - t) * 1000 / n

    # -- the card and the model ---------------------------------------------------------------------
    def card(self) -> dict:
        if not self.cuda:
            return {"name": "CPU (tiny smoke run)", "bandwidth_GBps": None}
        p = torch.cuda.get_device_properties(self.dev)
        x = torch.empty(GiB, dtype=torch.uint8, device=self.dev)
        y = torch.empty_like(x).random_(0, 255)
        for _ in range(3):
            x.copy_(y)
        ms = statistics.median([self.timed(lambda: x.copy_(y), 1) for _ in range(10)])
        bw = 2 * GiB / (ms / 1000) / 1e9
        return {
            "name": p.name,
            "memory_GiB": round(p.total_memory / GiB, 1),
            "bandwidth_GBps": round(bw, 1),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        }

    def build(self):
        from transformers import AutoConfig, LlamaForCausalLM

        from kvlab.model.handle import ModelHandle

        cfg = AutoConfig.from_pretrained(HERE.parent / "tests/fixtures/model-configs/llama-3.1-8b.json")
        dtype = torch.float32 if self.args.tiny else torch.bfloat16
        if self.args.tiny:
            cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 256, 512
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size = 4, 2, 64, 1024
        cfg._attn_implementation = "sdpa"
        cfg.dtype = dtype
        torch.manual_seed(0)
        with torch.device(self.dev):
            model = LlamaForCausalLM(cfg).to(dtype).eval()
        # a named digest: random weights need no 16 GB hash to get a store namespace
        self.handle = ModelHandle(
            model, None, name="llama-3.1-8b-geometry-random", weights_digest="random-seed-0"
        )
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = model.model.embed_tokens.weight
        read = params - (0 if embed is model.lm_head.weight else embed.numel() * embed.element_size())
        t = cfg.get_text_config()
        self.kv_per_token = (
            2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * 2
            if not self.args.tiny
            else (2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * 4)
        )
        self.weights_read = read
        return {
            "config": "Llama-3.1-8B geometry" if not self.args.tiny else "tiny Llama (smoke run)",
            "dtype": str(dtype),
            "parameters_GB": round(params / 1e9, 2),
            "weight_bytes_read_per_step_GB": round(read / 1e9, 2),
            "kv_bytes_per_token": self.kv_per_token,
        }

    def floor_ms(self, context: int) -> float | None:
        bw = self.res["sections"].get("card", {}).get("bandwidth_GBps")
        if not bw:
            return None
        return (self.weights_read + context * self.kv_per_token) / (bw * 1e9) * 1000

    def ids(self, n: int, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        vocab = self.handle.config.vocab_size
        return torch.randint(0, vocab, (1, n), generator=g).to(self.dev)

    # -- the split kernel's launch shape ---------------------------------------------------------------
    def split_launch(self, L: int) -> dict:
        """Time the split-KV attention alone (kernel + merge) for one decode step (4 query rows per KV head)
        and one 64-token chunk (256 rows) over ``L`` slots at 8B geometry, plain bf16 and int4 rows, under
        several (rows per program, warps, stages); the fastest of each becomes the launch every later
        section uses (``split_attention.LAUNCH``), and the table says which that was."""
        from kvlab.kernels import split_attention as sa
        from kvlab.policy.quant.codecs.int4rows import pack_rows

        if not sa.prepare(self.dev):
            return {"skipped": "no Triton or no CUDA"}
        g = torch.Generator(device=self.dev).manual_seed(0)
        c = L + SINKS + CHUNK
        k, v = (
            torch.randn(1, 8, c, 128, generator=g, device=self.dev, dtype=torch.bfloat16) for _ in range(2)
        )
        packed = (pack_rows(k, 32), pack_rows(v, 32))
        # (rows per program, warps, stages, keys per block, programs per multiprocessor); the first of
        # each list is run 4's choice, the library's default
        shapes = {
            "few": (
                (16, 4, 2, 64, 4), (16, 4, 4, 64, 4), (16, 4, 3, 64, 4), (16, 8, 3, 64, 4),
                (16, 4, 2, 128, 4), (16, 4, 2, 64, 8), (16, 4, 2, 64, 2),
            ),
            "many": (
                (128, 8, 2, 64, 4), (128, 8, 3, 64, 4), (64, 8, 3, 64, 4), (128, 8, 2, 128, 4),
                (128, 8, 2, 64, 1), (128, 8, 2, 64, 2), (128, 8, 3, 128, 1), (128, 8, 2, 128, 2),
            ),
        }  # fmt: skip
        table: dict = {}
        slot_pos = torch.arange(c, device=self.dev)  # a full window; the feed's own slots come last
        for kind, n in (("few", 1), ("many", CHUNK)):
            q = torch.randn(1, 8, 4 * n, 128, generator=g, device=self.dev, dtype=torch.bfloat16)
            rule = (slot_pos, torch.arange(c - n, c, device=self.dev)[None])
            visible = slot_pos[None, None, None, :] <= rule[1][:, None, :, None]
            mask = torch.where(visible, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
            for int4, (kk, vv) in ((False, (k, v)), (True, packed)):

                def replayed(
                    shape: tuple, given: tuple | None, kind=kind, int4=int4, kk=kk, vv=vv, q=q, mask=mask
                ):
                    sa.LAUNCH[(kind, int4)] = shape
                    call = functools.partial(sa.attend, q, kk, vv, mask, 0.088, given)
                    try:
                        for _ in range(3):
                            call()
                        graph = torch.cuda.CUDAGraph()  # replayed: the kernels' time, not Python's
                        with torch.cuda.graph(graph):
                            call()
                        return round(statistics.median(self.timed(graph.replay, 20) for _ in range(3)), 4)
                    except Exception as exc:  # a launch this card cannot run (registers, shared memory)
                        return type(exc).__name__

                # the rolling decoder gives the kernel the mask's rule (positions): the sweep times that
                times = {"x".join(map(str, shape)): replayed(shape, rule) for shape in shapes[kind]}
                ok = {s_: t for s_, t in times.items() if isinstance(t, float)}
                best = min(ok, key=ok.__getitem__)
                chosen = tuple(int(x) for x in best.split("x"))
                # paired, same launch: the kernel reading the mask's tiles instead (before this change)
                table[f"{kind}{'_int4' if int4 else ''}"] = {
                    "ms": times,
                    "chosen": best,
                    "chosen_reading_the_mask_ms": replayed(chosen, None),
                }
                sa.LAUNCH[(kind, int4)] = chosen  # type: ignore[assignment]
        return table

    # -- decode -------------------------------------------------------------------------------------
    def dynamic(self, L: int) -> dict:
        from transformers import DynamicCache

        m, ids = self.handle.model, self.ids(L)
        cache = DynamicCache(config=m.config)
        tok = m(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        state = {"tok": tok}

        def step():
            out = m(input_ids=state["tok"], cache=cache, logits_to_keep=1)
            state["tok"] = out.logits[:, -1].argmax(-1, keepdim=True)

        self.timed(step, 3)
        ms = self.timed(step, self.args.steps)
        return {"ms_per_token": round(ms, 3), "cache_GiB": round(L * self.kv_per_token / GiB, 3)}

    def static_compiled(self, L: int) -> dict:
        from transformers import StaticCache

        m, ids, n = self.handle.model, self.ids(L), self.args.steps
        cache = StaticCache(config=m.config, max_cache_len=L + n + 8)
        pos = torch.arange(L, device=self.dev)[None]
        tok = (
            m(input_ids=ids, cache=cache, position_ids=pos, logits_to_keep=1)
            .logits[:, -1]
            .argmax(-1, keepdim=True)
        )
        fwd = torch.compile(m.forward, mode="reduce-overhead")  # transformers' own static-cache recipe
        state = {"tok": tok, "p": L}

        def step():
            p = torch.full((1, 1), state["p"], device=self.dev, dtype=torch.long)
            out = fwd(input_ids=state["tok"], cache=cache, position_ids=p, logits_to_keep=1)
            state["tok"] = out.logits[:, -1].argmax(-1, keepdim=True).clone()
            state["p"] += 1

        t = time.perf_counter()
        self.timed(step, 3)
        compile_s = time.perf_counter() - t
        ms = self.timed(step, n)
        return {"ms_per_token": round(ms, 3), "compile_s": round(compile_s, 1)}

    def rolling(self, L: int, mode: str, codec: str = "none", check: bool = False) -> dict:
        from kvlab.hf.graphs import RollingDecoder
        from kvlab.hf.static_rolling import static_rolling_cache_for

        h, ids = self.handle, self.ids(L)
        cache = static_rolling_cache_for(h, window=L - SINKS, sinks=SINKS, evict_chunk=CHUNK, codec=codec)
        dec = RollingDecoder(h, cache, mode=mode)
        tok = dec.prefill(ids).argmax(-1, keepdim=True)
        state = {"tok": tok, "logits": []}

        def step():
            logits = dec.feed(state["tok"])
            state["tok"] = logits.argmax(-1, keepdim=True)

        t = time.perf_counter()
        self.timed(step, 3)
        capture_s = time.perf_counter() - t
        rolls = cache.rolls
        torch.cuda.reset_peak_memory_stats() if self.cuda else None
        before = torch.cuda.memory_allocated() if self.cuda else 0
        ms = self.timed(step, self.args.steps)
        peak = (torch.cuda.max_memory_allocated() - before) if self.cuda else 0
        out = {
            "ms_per_token": round(ms, 3),
            "capture_or_compile_s": round(capture_s, 1),
            "rolls_in_timed_steps": cache.rolls - rolls,
            "cache_GiB": round(cache.nbytes() / GiB, 3),
            "cache_bytes": cache.nbytes(),
            "step_transient_GiB": round(peak / GiB, 3),
        }
        if check:  # the captured steps against the same steps run eagerly, from a copy of the state
            out["vs_eager_max_abs_logit_diff"] = self.versus_eager(dec, cache, codec)
        return out

    def versus_eager(self, dec, cache, codec: str) -> float:
        """Feed 70 teacher-forced tokens (a roll included) through ``dec`` and through an eager decoder on
        a copy of its cache; the largest logit difference."""
        from kvlab.hf.graphs import RollingDecoder

        twin = cache.clone()
        eager = RollingDecoder(self.handle, twin, mode="eager")
        feed = self.ids(70, seed=7)[0]
        worst = 0.0
        for t in feed:
            a, b = dec.feed(t.view(1, 1)), eager.feed(t.view(1, 1))
            worst = max(worst, float((a - b).abs().max()))
        return worst

    def first_step_vs_dynamic(self, L: int) -> dict:
        """One decode step after the same prompt: the rolling cache (captured) vs DynamicCache (eager)."""
        from transformers import DynamicCache

        from kvlab.hf.graphs import RollingDecoder
        from kvlab.hf.static_rolling import static_rolling_cache_for

        m, ids = self.handle.model, self.ids(L + 1, seed=3)
        cache = DynamicCache(config=m.config)
        m(input_ids=ids[:, :L], cache=cache, logits_to_keep=1)
        ref = m(input_ids=ids[:, L:], cache=cache, logits_to_keep=1).logits[:, -1].float()
        del cache
        sc = static_rolling_cache_for(self.handle, window=L + 64, sinks=SINKS, evict_chunk=CHUNK)
        dec = RollingDecoder(self.handle, sc, mode="cuda-graph" if self.cuda else "eager")
        dec.prefill(ids[0, :L])
        got = dec.feed(ids[:, L:])
        scale = float(ref.abs().max())
        return {
            "max_abs_logit_diff": round(float((got - ref).abs().max()), 5),
            "logit_scale": round(scale, 3),
            "same_argmax": bool(got.argmax() == ref.argmax()),
        }

    # -- the roll and the store ---------------------------------------------------------------------
    def roll_vs_prefill(self, L: int, mode: str = "cuda-graph") -> dict:
        from transformers import DynamicCache

        from kvlab.hf.graphs import RollingDecoder
        from kvlab.hf.static_rolling import static_rolling_cache_for
        from kvlab.kernels import split_attention as sa

        h, m = self.handle, self.handle.model
        chunks = self.ids(CHUNK * 8, seed=5).view(8, 1, CHUNK)
        run_mode = mode if self.cuda or mode == "compile" else "eager"

        def rolls(tag: str, profile: bool) -> tuple[list[float], int]:
            cache = static_rolling_cache_for(h, window=L - SINKS, sinks=SINKS, evict_chunk=CHUNK)
            dec = RollingDecoder(h, cache, mode=run_mode)  # type: ignore[arg-type]
            dec.prefill(self.ids(L))
            for i in range(2):  # capture the 64-token feed (the window is full: every feed rolls)
                dec.feed(chunks[i])
            before = cache.rolls
            feeds = [self.timed(lambda c=c: dec.feed(c), 1) for c in chunks[2:]]
            rolled = cache.rolls - before
            if profile:
                self.profile(f"roll{tag}_{L}", lambda: dec.feed(chunks[2]))
                if mode == "cuda-graph":
                    self.profile(f"decode_step{tag}_{L}", lambda: dec.feed(chunks[3][:, :1]))
            return feeds, rolled

        feeds, rolled = rolls("" if mode == "cuda-graph" else f"_{mode}", True)
        self.free()
        paired: dict = {}
        if mode == "cuda-graph" and sa.prepare(self.dev):
            # the same rolls with the kernel reading the mask's tiles (as before it took the positions)
            given = sa.attend
            sa.attend = lambda q, k, v, mask, scale, visibility=None: given(q, k, v, mask, scale)
            try:
                masked, _ = rolls("_reading_mask", False)
            finally:
                sa.attend = given
            self.free()
            paired = {
                "roll_ms_reading_the_mask_median": round(statistics.median(masked), 2),
                "roll_ms_reading_the_mask_each": [round(x, 2) for x in masked],
            }

        def prefill():
            c = DynamicCache(config=m.config)
            m(input_ids=self.ids(L, seed=9), cache=c, logits_to_keep=1)

        prefill()
        prefills = [self.timed(prefill, 1) for _ in range(2)]
        roll_ms, pre_ms = statistics.median(feeds), statistics.median(prefills)
        return {
            "roll_ms_median": round(roll_ms, 2),
            "roll_ms_each": [round(x, 2) for x in feeds],
            "rolls_in_timed_feeds": rolled,
            "reprefill_ms_median": round(pre_ms, 1),
            "reprefill_ms_each": [round(x, 1) for x in prefills],
            "ratio": round(pre_ms / roll_ms, 1),
            **paired,
        }

    def store(self, L: int) -> dict:
        from kvlab.store.reuse import prefill_with_store
        from kvlab.store.store import open_store

        h = self.handle
        ids = self.ids(L, seed=11)[0].tolist()
        folder = tempfile.mkdtemp(prefix="kvlab-gpu-store-")
        store = open_store(folder, memory_bytes=4 * GiB, disk_bytes=8 * GiB)

        def plain():
            h.prefill(ids, all_logits=False)

        plain()
        miss = statistics.median(self.timed(plain, 1) for _ in range(2))
        prefill_with_store(h, store, ids)  # a miss that stores the prompt's blocks
        self.sync()
        mem = [prefill_with_store(h, store, ids, store_prompt=False) for _ in range(3)]
        disk_store = open_store(folder, memory_bytes=4 * GiB, disk_bytes=8 * GiB)  # empty memory tier
        disk = prefill_with_store(h, disk_store, ids, store_prompt=False)
        self.sync()
        return {
            "prefill_ms": round(miss, 1),
            "hit_memory_ttft_ms": round(statistics.median(p.ttft_ms for p in mem), 1),
            "hit_disk_ttft_ms (page cache)": round(disk.ttft_ms, 1),
            "cached_tokens": mem[-1].cached_tokens,
            "hit_on_device": str(mem[-1].snapshot.keys[0].device),
        }


def report(b: Bench) -> str:
    r, s = b.res, b.res["sections"]
    card = s.get("card", {})
    lines = [
        f"Card: **{card.get('name', '?')}** ({card.get('memory_GiB', '?')} GiB), measured copy bandwidth "
        f"{card.get('bandwidth_GBps', '?')} GB/s; torch {card.get('torch', torch.__version__)}, transformers "
        f"{card.get('transformers', '?')}. Model: {s.get('model', {}).get('config', '?')}, "
        f"{s.get('model', {}).get('dtype', '?')}, random weights, batch 1, SDPA. Steps timed per row: "
        f"{b.args.steps} (after 3 warm-up steps that capture or compile).",
        "",
        "| decode | context | ms / token | vs StaticCache + compile | vs bandwidth floor | cache held | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, v in s.items():
        if key.startswith("split_launch_") and "skipped" not in v:
            lines[-2:-2] = [
                f"Split-KV attention alone at {key.rsplit('_', 1)[1]} slots (ms per replayed call of kernel + "
                "merge; rows per program x warps x stages x keys per block x programs per SM; the chosen "
                "launch is what every row below ran):",
                "",
                *(
                    f"- {kind}: chosen {t['chosen']} (the same launch reading the mask's tiles instead of "
                    f"the positions: {t.get('chosen_reading_the_mask_ms', '—')}); {t['ms']}"
                    for kind, t in v.items()
                ),
                "",
            ]
    for L in b.contexts:
        base = s.get(f"static_compiled_{L}", {}).get("ms_per_token")
        floor = b.floor_ms(L)
        for key, label in [
            (f"dynamic_{L}", "transformers `DynamicCache`, eager"),
            (f"static_compiled_{L}", "transformers `StaticCache` + `torch.compile` (reduce-overhead)"),
            (f"rolling_graph_{L}", "kvlab `StaticRollingCache`, CUDA graph"),
            (f"rolling_compile_{L}", "kvlab `StaticRollingCache`, `torch.compile` (reduce-overhead)"),
            (f"rolling_int4_graph_{L}", "kvlab `StaticRollingCache` int4, CUDA graph"),
            (f"rolling_int4_compile_{L}", "kvlab `StaticRollingCache` int4, `torch.compile`"),
        ]:
            v = s.get(key)
            if v is None:
                why = r["errors"].get(key) or r["skipped"].get(key) or "not run"
                lines.append(f"| {label} | {L:,} | — | | | | {why[:120]} |")
                continue
            ms = v["ms_per_token"]
            notes = []
            if "compile_s" in v:
                notes.append(f"compiled in {v['compile_s']} s")
            if "capture_or_compile_s" in v:
                notes.append(f"warm-up incl. capture/compile {v['capture_or_compile_s']} s")
            if v.get("rolls_in_timed_steps"):
                notes.append(f"{v['rolls_in_timed_steps']} roll(s) in the timed steps")
            if "vs_eager_max_abs_logit_diff" in v:
                notes.append(f"max logit diff vs eager steps {v['vs_eager_max_abs_logit_diff']:.2g}")
            cache = v.get("cache_GiB")
            lines.append(
                f"| {label} | {L:,} | {ms:.2f} | {ms / base:.2f}x | "
                f"{(f'{ms / floor:.2f}x' if floor else '—')} | {f'{cache:.2f} GiB' if cache else ''} | "
                f"{'; '.join(notes)} |"
                if base
                else f"| {label} | {L:,} | {ms:.2f} | — | {(f'{ms / floor:.2f}x' if floor else '—')} | "
                f"{f'{cache:.2f} GiB' if cache else ''} | {'; '.join(notes)} |"
            )
        if floor:
            lines.append(
                f"| bandwidth floor (weights + cache read once) | {L:,} | {floor:.2f} | | 1.00x | | |"
            )
    for L in b.contexts:
        fp, q = s.get(f"rolling_graph_{L}"), s.get(f"rolling_int4_graph_{L}")
        if fp and q:
            lines.append(
                f"\nint4 vs full-precision rolling at {L:,} (CUDA graphs): step {q['ms_per_token'] / fp['ms_per_token']:.2f}x, "
                f"cache held {q['cache_bytes'] / fp['cache_bytes']:.2f}x ({q['cache_GiB']:.2f} vs {fp['cache_GiB']:.2f} GiB)."
            )
        fc, qc = s.get(f"rolling_compile_{L}"), s.get(f"rolling_int4_compile_{L}")
        if fc and qc:
            lines.append(
                f"int4 vs full-precision rolling at {L:,} (torch.compile): step {qc['ms_per_token'] / fc['ms_per_token']:.2f}x."
            )
    for key, v in s.items():
        if key.startswith("roll_vs_prefill"):
            lines.append(
                f"\nRoll at {key.rsplit('_', 1)[1]} tokens (64 tokens fed past a full window, one "
                f"{'compiled' if 'compile' in key else 'captured'} forward, "
                f"{v['rolls_in_timed_feeds']} rolls timed): **{v['roll_ms_median']} ms** vs re-prefill of the window "
                f"{v['reprefill_ms_median']} ms: **{v['ratio']}x cheaper** (each roll: {v['roll_ms_each']} ms)."
                + (
                    f" Paired, same run: the kernel reading the mask's tiles instead of the positions, "
                    f"{v['roll_ms_reading_the_mask_median']} ms a roll ({v['roll_ms_reading_the_mask_each']})."
                    if "roll_ms_reading_the_mask_median" in v
                    else ""
                )
            )
        if key.startswith("first_step_vs_dynamic"):
            lines.append(
                f"\nFirst decode step after the same prompt, rolling (captured) vs `DynamicCache` (eager): max |logit "
                f"difference| {v['max_abs_logit_diff']} on logits up to {v['logit_scale']} "
                f"({s.get('model', {}).get('dtype', '?')}), same argmax: "
                f"{v['same_argmax']}."
            )
        if key.startswith("store_"):
            lines.append(
                f"\nStore at {key.rsplit('_', 1)[1]} tokens: prefill {v['prefill_ms']} ms; hit from the memory tier "
                f"{v['hit_memory_ttft_ms']} ms, from the disk tier (page cache) {v['hit_disk_ttft_ms (page cache)']} ms "
                f"time to first token ({v['cached_tokens']} tokens loaded onto {v['hit_on_device']})."
            )
    for name, why in {**r["errors"], **r["skipped"]}.items():
        if not name.startswith(("dynamic_", "static_", "rolling_")):
            lines.append(f"\n{name}: {why}")
    lines.append(f"\nSection times (s): {json.dumps(r.get('seconds', {}))}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu-raw"))
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny model on the CPU: a smoke run of every section"
    )
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/gpu.md")
    ap.add_argument(
        "--only", type=lambda v: set(v.split(",")), default=set(), help="these sections (comma-separated)"
    )
    args = ap.parse_args()
    torch.set_grad_enabled(False)  # inference only: no autograd graph kept alive by the timed forwards
    b = Bench(args)
    short, long = (256, 512) if args.tiny else (8192, 32768)
    b.contexts = [short, long]
    cuda = b.cuda
    b.section("card", 0, b.card)
    b.section("model", 0, b.build)
    graph = "cuda-graph" if cuda else "eager"
    # most valuable first: a section runs only if the budget left covers its estimate
    b.section(f"split_launch_{long}", 30, b.split_launch, long)
    b.section(f"rolling_graph_{short}", 15, b.rolling, short, graph, "none", True)
    b.section(f"static_compiled_{short}", 60, b.static_compiled, short)  # the bar's pair, first
    b.section(f"roll_vs_prefill_{long}", 35, b.roll_vs_prefill, long)
    b.section(f"dynamic_{short}", 10, b.dynamic, short)
    b.section(f"first_step_vs_dynamic_{short}", 10, b.first_step_vs_dynamic, short)
    b.section(f"rolling_int4_graph_{short}", 15, b.rolling, short, graph, "int4", True)
    b.section(f"rolling_graph_{long}", 15, b.rolling, long, graph)
    b.section(f"rolling_int4_graph_{long}", 15, b.rolling, long, graph, "int4")
    b.section(f"dynamic_{long}", 12, b.dynamic, long)
    b.section(f"store_{short}", 30, b.store, short)
    b.section(f"rolling_compile_{short}", 60, b.rolling, short, "compile")
    b.section(f"roll_vs_prefill_compile_{long}", 90, b.roll_vs_prefill, long, "compile")
    b.section(f"rolling_int4_compile_{short}", 100, b.rolling, short, "compile", "int4")
    b.section(f"static_compiled_{long}", 110, b.static_compiled, long)
    b.section(f"rolling_compile_{long}", 110, b.rolling, long, "compile")
    text = report(b)
    (b.out / "gpu.md").write_text(text)
    print(text)
    if args.write:
        write_results("gpu", "GPU: decode, roll and store at Llama-3.1-8B geometry (issue 29)", text)


if __name__ == "__main__":
    main()
