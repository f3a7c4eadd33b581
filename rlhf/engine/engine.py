"""The generation engine: requests in, finished samples out.

Ties the layers together, top to bottom: `Scheduler` (policy, budget,
preemption) -> `KVManager` (block tables) -> `BlockPool` (ref counts, free
queue, prefix map) -> `TPDecoder` (tensors only). One `step()`:

    schedule -> build flat step inputs -> advance num_computed, register full blocks
    -> fork the n samples of a prompt whose prefill just ended
    -> decoder forward and sampling (tokens and log-probs of the rows that sample; a decode step
       in one recorded CUDA graph with ``cuda_graphs``) -> the sampled tokens stay pending on the device

and reads the previous step's tokens on the host (finish / keep running) *after* launching its own when it
can do without them: a pure decode step of the same sequences takes its input ids from the device
(`_InFlight`), so on a GPU the host never waits for the step it just queued. Samples are then found
finished a step late; the token computed for them meanwhile is dropped.

Every TP rank of the generation mesh runs the same engine on the same
requests; decisions depend only on tokens, so the ranks stay in lockstep.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

import torch

from rlhf.engine.attention import AttentionMeta
from rlhf.engine.decoder import StepInputs, TPDecoder
from rlhf.engine.kv_manager import KVManager, blocks_for
from rlhf.engine.migration import MigratedSequence
from rlhf.engine.sampler import SampleInputs, mixed_seed
from rlhf.engine.scheduler import Scheduler, SchedulerOutput
from rlhf.engine.sequence import Sequence, Status
from rlhf.engine.types import (EngineConfig, EngineConfigError, NeverFitsError, OutOfBlocksError, Request,
                               SampleResult, SamplingParams)
from rlhf.models.config import ModelConfig


@dataclass
class EngineStats:
    """Counters (plain ints, no device syncs) and per-step history."""

    steps: int = 0
    generated_tokens: int = 0
    computed_tokens: int = 0
    elapsed_s: float = 0.0
    preemptions: int = 0
    held_evictions: int = 0  # held samples (between turns) whose K/V gave way to work that could not start
    peak_blocks_used: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # running sequences per step
    blocks_used: list[int] = field(default_factory=list)  # after each step
    finish_times: dict[tuple[str, int], float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0


@dataclass
class _InFlight:
    """A step's sampled tokens the host has not read yet: the sequence of each row, the tokens [S] on the
    device (a next step's input ids), their copies and the log-probs' [S] on the way to the host, and the
    event marking their arrival (None on the CPU, where the copies are the tensors themselves)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor]
    arrived: torch.Event | None
    read: bool = False


class Engine:
    """Paged-KV, continuously batched generation with the actor's TP-sharded weights.

    ``model``: this rank's actor_gen GPTModel (pp=1), filled by `reshard`;
    ``groups``: its TaskGroups (TP group used for the forward's collectives), or None for
    one process without TP (as tools/generate.py runs it). ``policy_version``: None, or
    the version of the weights (set by `refresh_weights`) recorded with every token sampled.
    """

    def __init__(self, model: torch.nn.Module, groups, model_cfg: ModelConfig,
                 config: EngineConfig = EngineConfig()):
        if config.record_routing and not model_cfg.is_moe:
            raise EngineConfigError("record_routing=True needs a mixture-of-experts model (num_experts > 0); "
                                    "this model is dense", "record_routing")
        self.config = config
        self.max_len = config.max_model_len or model_cfg.max_seq_len
        self.kv = KVManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.kv, config.max_tokens_per_step, config.max_num_seqs,
                                   config.continuous_batching, config.prefix_sharing)
        self.decoder = TPDecoder(model, groups.tp if groups is not None else None, model_cfg, config.num_blocks,
                                 config.block_size, self.max_len, config.attention_backend, config.cuda_graphs,
                                 config.record_routing)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seqs: dict[tuple[str, int], Sequence] = {}
        self._held: dict[tuple[str, int], Sequence] = {}  # finished turns keeping their K/V, oldest first
        self._pending: _InFlight | None = None  # the last step's tokens, until read (see step)
        self._done: list[SampleResult] = []  # found finished, returned by the next step
        self._t0: float | None = None
        self.policy_version: int | None = None

    # ---- requests -----------------------------------------------------------------

    def check_fits(self, request: Request) -> None:
        """Raise `NeverFitsError` when no amount of waiting lets ``request`` run."""
        p = len(request.prompt)
        if p + 1 > self.max_len:
            raise NeverFitsError(f"request {request.request_id!r}: prompt of {p} tokens leaves no room to "
                                 f"generate within max_model_len={self.max_len}; shorten the prompt")
        self._check_blocks(request.request_id, p, request.params.max_new_tokens)

    def _check_blocks(self, request_id: str, prompt_len: int, max_new_tokens: int) -> None:
        """One sample alone must fit the pool, or preemption could not make room for it."""
        need = blocks_for(min(prompt_len + max_new_tokens, self.max_len), self.config.block_size)
        if need > self.config.num_blocks:
            raise NeverFitsError(f"request {request_id!r} needs {need} KV blocks but the pool has "
                                 f"{self.config.num_blocks}; raise num_blocks or lower max_new_tokens")

    def add_request(self, request: Request) -> None:
        """Queue ``request``'s n samples (one prefill for all of them with prefix sharing)."""
        self.check_fits(request)
        n = request.params.n
        share = self.config.prefix_sharing and n > 1
        for i in range(1 if share else n):
            seq = self._new_sequence(request.request_id, i, request.prompt, request.params)
            seq.pending_forks = list(range(1, n)) if share else []
            seq.hold = request.hold
            self.scheduler.add(seq)

    def _new_sequence(self, request_id, index, prompt, params) -> Sequence:
        key = (request_id, index)
        if key in self._seqs or key in self._held:
            state = "running" if key in self._seqs else "held for a next turn"
            raise ValueError(f"sample {index} of request {request_id!r} is already {state} in this engine")
        seq = Sequence(next(self._ids), request_id, index, len(prompt), list(prompt), params,
                       mixed_seed(params.seed, index))
        self._seqs[key] = seq
        return seq

    def has_unfinished(self) -> bool:
        """Whether `step` has samples still to return."""
        return bool(self._seqs or self._done)

    def exportable(self) -> list[tuple[str, int, int]]:
        """(request_id, sample_index, tokens so far) of the unfinished samples `export_sequence` takes now,
        sorted (a request still prefilling for its other samples is left out until its first token). Reads
        the pending tokens but changes nothing the next step does (a sample they finish is left out)."""
        if self._pending is not None:
            self._read(self._pending)
        return sorted((s.request_id, s.sample_index, len(s.tokens)) for s in self._seqs.values()
                      if not s.pending_forks and s.finish_reason is None)

    def refresh_weights(self, version: int, keep_kv: bool = False) -> None:
        """The model's weights were just replaced (an asynchronous run's reshard; docs/async.md, "Partial
        rollouts"): tokens sampled from now on are recorded under ``version``. Unfinished samples keep
        their tokens and log-probs; their K/V, computed by the old weights, are computed again by prefill
        (or, ``keep_kv``, kept: cheaper, but the new tokens then attend to the old weights' K/V). No block
        computed before is shared by a prefix match again."""
        self._flush()  # the pending tokens were sampled by the old weights
        self.policy_version = version
        self.kv.pool.forget_prefixes()
        if not keep_kv:
            while self._evict_held():
                pass
            for seq in reversed(list(self.scheduler.running)):  # newest first: the oldest ends up in front
                self.scheduler.preempt(seq)

    def forget_graphs(self) -> None:
        """Drop the recorded decode-step graphs (`EngineConfig.cuda_graphs`), which hold the addresses of the
        weights and KV cache: for when their storage is freed (``memory.release_generation_memory``)."""
        self._flush()  # the pending tokens may be a graph's output
        if self.decoder.static is not None:
            self.decoder.static.forget()

    def abort_all(self) -> None:
        """Drop every unfinished sample (its blocks freed); nothing is returned for them."""
        self._pending, self._done = None, []
        for seq in self._seqs.values():
            self.scheduler.finish(seq)
        self._seqs.clear()
        for key in list(self._held):
            self.release(*key)

    def generate(self, requests) -> list[SampleResult]:
        """Run ``requests`` to completion; results in request order, then sample index."""
        for r in requests:
            self.add_request(r)
        done = {}
        while self.has_unfinished():
            steps = self.stats.steps
            finished = self.step()
            done.update(((res.request_id, res.sample_index), res) for res in finished)
            if self.stats.steps == steps and not finished:  # cannot happen: the oldest sequence always fits
                raise RuntimeError(f"engine made no progress: {self.snapshot()}")
        self._flush()  # tokens computed for samples found finished meanwhile: dropped
        return [done[(r.request_id, i)] for r in requests for i in range(r.params.n)]

    # ---- one step -----------------------------------------------------------------

    def step(self) -> list[SampleResult]:
        """Schedule, run the decoder once and sample; returns the samples found finished.

        A step's sampled tokens stay on the device (`_InFlight`) until the host needs them. When every running
        sequence sampled in the last step and the scheduler can give each its token in flight without a
        decision (`Scheduler.schedule_in_flight`: nobody to admit, nobody to preempt), this step computes those
        tokens straight from the device and reads them only after it is launched; otherwise the pending tokens
        are read first and the scheduler decides on them. Tokens that end a sample by its length are read by
        the step that sampled them (no later step could run ahead of them). A sample ended by a stop id is so
        found finished up to a step late: the token computed for it meanwhile is dropped (never returned or
        counted) and its blocks freed."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        ahead = self._pending
        out = (self.scheduler.schedule_in_flight()
               if ahead is not None and self.scheduler.running == ahead.seqs else None)
        if out is not None:
            self._launch(out, ahead)
            self._read(ahead)  # on a GPU the step it launched has these tokens computed by now
            self._retire(ahead)
        else:
            self._flush()
            out = self.scheduler.schedule()
            while not out.scheduled and self.scheduler.waiting and self._evict_held():
                out = self.scheduler.schedule()  # held turns' K/V gave way to work that could not start
            self.stats.preemptions += len(out.preempted)
            if not out.scheduled:
                return self._take_done()
            self._launch(out)
        if self._pending is not None and self._ends_by_length(self._pending):
            self._flush()  # the next step is the scheduler's to decide: read now, the finish returned now
        self._record(out)
        return self._take_done()

    def _ends_by_length(self, step: _InFlight) -> bool:
        """Whether a token of ``step`` is its sample's last by length (known before the token is read)."""
        return any(self._length_reason(s, s.num_computed + 1) for s in step.seqs if s.status is Status.RUNNING)

    def _launch(self, out: SchedulerOutput, ahead: _InFlight | None = None) -> None:
        """Queue the scheduled step (``ahead``: its input ids are these tokens in flight); its sampled tokens
        become the pending ones."""
        inputs, samplers = self._prepare(out)
        if ahead is not None:
            inputs = replace(inputs, input_ids=ahead.tokens)
        for seq, n in out.scheduled:
            seq.num_computed += n
            if self.config.prefix_sharing and ahead is None:  # else once the token in flight is read
                self.kv.register_full_blocks(seq.seq_id, seq.tokens, seq.num_computed)
        rows = self._fork(samplers)
        if len(rows) > len(inputs.logits_rows):  # forked samples draw from their parent's logits row
            inputs = replace(inputs, logits_rows=inputs.logits_rows[torch.tensor(rows, device=self.decoder.device)])
        self._pending = self._sample(inputs, samplers)

    def _take_done(self) -> list[SampleResult]:
        done, self._done = self._done, []
        return done

    def _prepare(self, out: SchedulerOutput) -> tuple[StepInputs, list[Sequence]]:
        """Flatten the scheduled token ranges into one batch (see attention.AttentionMeta). A token in flight
        is not in its sequence's tokens yet: its id is left out (`_launch` gives the step the device's)."""
        ids, pos, slots, q_starts, q_lens, ctx_lens, tables, rows, samplers = ([] for _ in range(9))
        for seq, n in out.scheduled:
            start = seq.num_computed
            q_starts.append(len(pos))
            ids.extend(seq.tokens[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(self.kv.slots(seq.seq_id, start, start + n))
            q_lens.append(n)
            ctx_lens.append(start + n)
            tables.append(self.kv.tables[seq.seq_id])
            if start + n >= len(seq.tokens):  # every token computed: sample the next one
                rows.append(len(pos) - 1)
                samplers.append(seq)
        dev = self.decoder.device
        width = max(len(t) for t in tables)
        decode = [i for i, n in enumerate(q_lens) if n == 1]
        meta = AttentionMeta(
            q_starts, q_lens, ctx_lens,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            decode_rows=decode, prefill_rows=[i for i, n in enumerate(q_lens) if n > 1],
            decode_ctx=torch.tensor([ctx_lens[i] for i in decode], dtype=torch.int32, device=dev),
            decode_tokens=torch.tensor([q_starts[i] for i in decode], dtype=torch.long, device=dev))
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        return StepInputs(t(ids), t(pos), t(slots), t(rows), meta, out.copies), samplers

    def _fork(self, samplers: list[Sequence]) -> list[int]:
        """Fork pending samples off parents whose prompt just finished; logits row per sampler."""
        rows = list(range(len(samplers)))
        for row, parent in enumerate(list(samplers)):
            for index in parent.pending_forks:
                child = self._new_sequence(parent.request_id, index, parent.tokens, parent.params)
                child.prompt_len, child.num_computed, child.hold = parent.prompt_len, parent.num_computed, parent.hold
                self.kv.fork(parent.seq_id, child.seq_id)
                self.scheduler.add_running(child)
                samplers.append(child)
                rows.append(row)
            parent.pending_forks = []
        return rows

    def _sample(self, inputs: StepInputs, seqs: list[Sequence]) -> _InFlight | None:
        """Queue the step's forward and the sampling of a token for each of ``seqs`` (one per logits row), and
        the copies of the tokens and log-probs to the host; None when nothing samples."""
        if not seqs:  # prefill chunks only: their K/V
            self.decoder.forward(inputs)
            return None
        sampling = SampleInputs.of([s.params for s in seqs], [s.seed for s in seqs], [s.counter for s in seqs],
                                   self.decoder.device)
        tokens, logps = self.decoder.forward_and_sample(inputs, sampling)
        host = tokens.to("cpu", non_blocking=True), logps.to("cpu", non_blocking=True)
        arrived = None
        if tokens.device.type != "cpu":
            arrived = torch.Event(device=tokens.device)
            arrived.record()
        return _InFlight(seqs, tokens, host, arrived)

    def _read(self, step: _InFlight) -> None:
        """Append ``step``'s tokens and log-probs to its sequences and note which finished (`_retire` ends
        them). A row of a sequence that finished at an earlier token was computed ahead: dropped."""
        if step.read:
            return
        step.read = True
        if step.arrived is not None:
            step.arrived.synchronize()
        # .tolist(): the scheduler needs the new ids on the host (stop checks, its decisions); the log-probs
        # ride along (SampleResult holds python floats)
        for seq, tok, lp in zip(step.seqs, step.host[0].tolist(), step.host[1].tolist()):
            if seq.status is not Status.RUNNING or seq.finish_reason is not None:
                continue
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            if self.policy_version is not None:
                seq.policy_versions.append(self.policy_version)
            self.stats.generated_tokens += 1
            seq.finish_reason = self._finish_reason(seq, tok)
            if seq.finish_reason is None and self.config.prefix_sharing:  # blocks a step ahead has filled
                self.kv.register_full_blocks(seq.seq_id, seq.tokens, seq.num_computed)

    def _retire(self, step: _InFlight) -> None:
        """End the sequences of the read ``step`` that finished; their results go out with the next `step`."""
        for seq in step.seqs:
            if seq.status is Status.RUNNING and seq.finish_reason is not None:
                self._done.append(self._finish(seq, seq.finish_reason))

    def _flush(self) -> None:
        """Read and retire the pending tokens: every sequence's tokens are then on the host, none in flight."""
        if self._pending is not None:
            self._read(self._pending)
            self._retire(self._pending)
            self._pending = None

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.params.stop_token_ids:
            return "stop"
        return self._length_reason(seq, len(seq.tokens))

    def _length_reason(self, seq: Sequence, num_tokens: int) -> str | None:
        """Why ``seq`` ends once it holds ``num_tokens`` tokens whatever they are: "length", "context" or None."""
        if num_tokens - seq.prompt_len >= seq.params.max_new_tokens_of(seq.sample_index):
            return "length"
        if num_tokens >= self.max_len:
            return "context"
        return None

    def _finish(self, seq: Sequence, reason: str) -> SampleResult:
        # every token but the one just sampled is computed (a step ahead's K/V of it are dropped), and its
        # blocks are still held
        seq.num_computed = len(seq.tokens) - 1
        routing = self._routing(seq, seq.num_computed).cpu() if self.config.record_routing else None
        if seq.hold:
            self.scheduler.set_aside(seq)
            self._held[seq.key] = seq
        else:
            self.scheduler.finish(seq)
        seq.status, seq.finish_reason = (Status.HELD if seq.hold else Status.FINISHED), reason
        del self._seqs[seq.key]
        now = time.perf_counter() - self._t0
        self.stats.finish_times[seq.key] = now
        return SampleResult(seq.request_id, seq.sample_index, tuple(seq.tokens[:seq.prompt_len]),
                            tuple(seq.output), tuple(seq.logprobs), reason, now, tuple(seq.policy_versions),
                            routing=routing)

    def _routing(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        """The routing record of ``seq``'s first ``num_tokens`` positions, from the decoder's routing cache."""
        return self.decoder.read_routing(self.kv.tables[seq.seq_id], num_tokens)

    def _record(self, out: SchedulerOutput) -> None:
        s, pool = self.stats, self.kv.pool
        s.steps += 1
        s.computed_tokens += out.num_tokens
        s.elapsed_s = time.perf_counter() - self._t0
        s.batch_sizes.append(len(out.scheduled))
        s.blocks_used.append(pool.num_used)
        s.peak_blocks_used = max(s.peak_blocks_used, pool.num_used)

    # ---- turns of a multi-turn sample -----------------------------------------------

    def continue_sample(self, request_id: str, sample_index: int, observation, params: SamplingParams,
                        hold: bool = True) -> None:
        """Start the next turn of a held sample (a `Request.hold` sample that finished): ``observation``
        (token ids) is appended to its tokens, which become the new turn's prompt, and it generates under
        ``params`` (``params.seed`` mixed with the sample index seeds the turn). Its K/V stay where they
        are: only the last sampled token and the observation are computed (all of it again if the K/V gave
        way under memory pressure). ``hold``: keep it again when this turn finishes."""
        self._flush()
        key = (request_id, sample_index)
        seq = self._held.get(key)
        if seq is None:
            raise KeyError(f"sample {sample_index} of request {request_id!r} is not held in this engine")
        tokens = seq.tokens + [int(t) for t in observation]
        if len(tokens) + 1 > self.max_len:
            raise NeverFitsError(f"sample {sample_index} of request {request_id!r}: {len(tokens)} tokens after "
                                 f"the observation leave no room to generate within max_model_len={self.max_len}")
        self._check_blocks(request_id, len(tokens), params.max_new_tokens)
        del self._held[key]
        seq.tokens, seq.prompt_len, seq.params, seq.hold = tokens, len(tokens), params, hold
        seq.logprobs, seq.policy_versions, seq.finish_reason = [], [], None
        seq.seed = mixed_seed(params.seed, sample_index)
        self._seqs[key] = seq
        if self.kv.tables.get(seq.seq_id):
            self.scheduler.add_running(seq)
        else:
            self.scheduler.add(seq)

    def release(self, request_id: str, sample_index: int) -> None:
        """End a held sample: its K/V blocks return to the pool."""
        self._flush()
        seq = self._held.pop((request_id, sample_index), None)
        if seq is None:
            raise KeyError(f"sample {sample_index} of request {request_id!r} is not held in this engine")
        self.kv.free(seq.seq_id)
        seq.status = Status.FINISHED

    def _evict_held(self) -> bool:
        """Free the K/V of the oldest held sample that still has some (it is computed again when it
        continues); False when none has."""
        for seq in self._held.values():
            if self.kv.tables.get(seq.seq_id):
                self.kv.free(seq.seq_id)
                seq.num_computed = 0
                self.stats.held_evictions += 1
                return True
        return False

    # ---- instrumentation ------------------------------------------------------------

    def snapshot(self) -> dict:
        """Current running/waiting counts, KV blocks used/free and throughput (the pending tokens read and
        their finished samples ended first)."""
        self._flush()
        pool = self.kv.pool
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_used": pool.num_used, "blocks_free": pool.num_free,
                "kv_bytes_used": pool.num_used * self.decoder.kv_bytes_per_block(),
                "tokens_per_s": self.stats.tokens_per_s, "preemptions": self.stats.preemptions}

    # ---- migration ------------------------------------------------------------------

    def export_sequence(self, request_id: str, sample_index: int, with_kv: bool = True) -> MigratedSequence:
        """Remove an unfinished sample from this engine and return its state (no token of it in flight)."""
        self._flush()
        seq = self._seqs.get((request_id, sample_index))
        if seq is None:
            raise KeyError(f"no unfinished sample {sample_index} of request {request_id!r} in this engine")
        if seq.pending_forks:
            raise ValueError(f"request {request_id!r} is still prefilling its prompt for its other samples; "
                             "export it after its first token")
        kv = routing = None
        if with_kv and seq.num_computed:
            kv = self.decoder.read_blocks(self.kv.tables[seq.seq_id], seq.num_computed)
            routing = self._routing(seq, seq.num_computed) if self.config.record_routing else None
        state = MigratedSequence(request_id, sample_index, seq.prompt_len, list(seq.tokens), list(seq.logprobs),
                                 seq.params, seq.num_computed if kv is not None else 0, kv, list(seq.policy_versions),
                                 routing)
        self.scheduler.finish(seq)
        del self._seqs[seq.key]
        return state

    def import_sequence(self, state: MigratedSequence) -> None:
        """Continue a migrated sample here. Raises `OutOfBlocksError` (retry later) if its K/V do not fit now.
        An engine recording routing re-prefills a sample whose K/V came without routing (to record it)."""
        self._flush()  # the blocks of samples found finished are free
        self._check_blocks(state.request_id, state.prompt_len, state.params.max_new_tokens)
        prompt = state.tokens[:state.prompt_len]
        seq = self._new_sequence(state.request_id, state.sample_index, prompt, state.params)
        seq.tokens, seq.logprobs = list(state.tokens), list(state.logprobs)
        seq.policy_versions = list(state.policy_versions)
        if state.kv is None or (self.config.record_routing and state.routing is None):
            self.scheduler.add(seq)
            return
        if self.kv.allocate_slots(seq.seq_id, 0, state.num_computed) is None:
            self.kv.free(seq.seq_id)
            del self._seqs[seq.key]
            raise OutOfBlocksError(f"{blocks_for(state.num_computed, self.config.block_size)} KV blocks needed "
                                   f"for sample {state.sample_index} of {state.request_id!r}, "
                                   f"{self.kv.pool.num_free} free; retry after some samples finish")
        self.decoder.write_blocks(self.kv.tables[seq.seq_id], state.kv.to(self.decoder.device))
        if self.config.record_routing:
            self.decoder.write_routing(self.kv.tables[seq.seq_id], state.routing)
        # keep >= 1 token to compute: the step that computes it samples the next one
        seq.num_computed = min(state.num_computed, len(seq.tokens) - 1)
        if self.config.prefix_sharing:
            self.kv.register_full_blocks(seq.seq_id, seq.tokens, seq.num_computed)
        self.scheduler.add_running(seq)
