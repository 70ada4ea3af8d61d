"""The server's configuration: the ``serve`` and ``mlflow`` sections of the pipeline's YAML.

The server owns these sections (compress/config.py's PipelineConfig embeds them), so it reads a
config file without the pipeline: ``load_serve_config`` validates only ``serve:`` and ``mlflow:``
and leaves the other sections to ``compressor run``. Same rules and error style as the pipeline's
loader (which reuses the helpers here): unknown keys are errors that name the key and the fix.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: which key, what is allowed."""


class Section(BaseModel):
    """A config section: unknown keys are errors, so a typo names the key instead of being ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Keys renamed so that each name means one thing: (section, old name) -> new name. The old names still work, with a
# FutureWarning naming the new one (docs/configuration.md lists them). The pipeline's sections share this table.
RENAMED_KEYS = {
    ("accept", "min_throughput_ratio"): "min_decode_speed_ratio",
    ("benchmark", "min_throughput_ratio"): "min_server_throughput_ratio",
    # three block sizes meant three things: data.block_size (tokens per text block) keeps its name
    ("quantize", "block_size"): "weight_block_size",
    ("serve", "block_size"): "kv_block_size",
    # one split, one name: the selection split's blocks (its figures are selection_*)
    ("data", "eval_blocks"): "selection_blocks",
}


def renamed_keys(data, section: str):
    """A section's mapping with its renamed keys under their new names (a deprecation warning for each)."""
    if not isinstance(data, dict):
        return data
    for (sec, old), new in RENAMED_KEYS.items():
        if sec != section or old not in data:
            continue
        if new in data:
            raise ValueError(f"{section}.{old} is the old name of {section}.{new}; give only {new}")
        warnings.warn(f"{section}.{old} is deprecated: it is now {section}.{new} (same meaning); rename it in "
                      f"your config", FutureWarning, stacklevel=3)
        data = {k: v for k, v in data.items() if k != old} | {new: data[old]}
    return data


class MlflowConfig(Section):
    # None = $MLFLOW_TRACKING_URI, else sqlite under <project>/mlruns (absolute path).
    tracking_uri: str | None = None
    # MLflow experiment the runs are logged under.
    experiment: str = "llm-compression"
    # Where people open the UI, for the links in Prefect states and artifacts, which are read outside it. None =
    # $MLFLOW_UI_URL, else the tracking server itself when tracking_uri is http(s), else unknown: the route is
    # given with "in the MLflow UI". Descriptions and summary.md link relatively, so they work on any port.
    ui_url: str | None = None


class ServeConfig(Section):
    # Address the server binds; 127.0.0.1 = this machine only.
    host: str = "127.0.0.1"
    # The server's HTTP port.
    port: int = Field(8000, ge=1, le=65535)
    # KV memory budget (bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes): the block pool *and*
    # the dense rows beside it together (gqa: the in-place rows; standard: the per-step past buffers, which get
    # half of their share because ORT's present outputs are as large again); kv_rows_share of it goes to the
    # rows (docs/serving.md, "One KV budget"). num_blocks, if set, sizes the pool instead (the rows then get
    # num_blocks x share / (1 - share), halved for standard).
    kv_memory_mb: int = Field(256, ge=1)
    # KV blocks in the pool; null = sized from kv_memory_mb (see above).
    num_blocks: int | None = Field(None, ge=1)
    # Share of the KV budget given to the dense rows (see kv_memory_mb).
    kv_rows_share: float = Field(0.5, gt=0, lt=1)
    # Tokens per KV block: the unit of the block pool and of prefix caching; formerly serve.block_size.
    kv_block_size: int = Field(16, ge=1, le=1024)
    # Reuse the KV blocks of a prompt prefix computed before (system prompts, chat history).
    enable_prefix_caching: bool = True
    # Rows decoding together. 64: every INT8 form's tokens/s still rose from 32 to 64 rows (benchmarks/history.md run 9);
    # the KV rows are allocated for the traffic there is, not for this many (serve/runners/gqa.py).
    max_batch_size: int = Field(64, ge=1)
    # Tokens one step computes (decodes + prompt chunks). A prompt's rows are bound by arithmetic, not by reading the
    # weights, so batching several long prompts into one call gains no speed and makes each wait for all: 512 against
    # vLLM's 2048 gave the demo's champion at 8 users of ~650-token prompts TTFT p50 2.7 s against 7.4, 1.12x the
    # prompt tokens/s and a third of the peak RSS, chat at 32 users 1.08x the tokens/s, 1 and 8 users unchanged
    # (benchmarks/results/sweep_budget_*.json; docs/serving.md#scheduling).
    max_num_batched_tokens: int = Field(512, ge=1)
    # How far the prompts after a step's first one may fill it: the oldest prompt row takes what the token budget
    # allows, the later ones share what is left of this chunk, so prompts arriving together finish one after another
    # instead of all at the end of one call. "auto": measured when the engine starts, the size past which a larger
    # prompt call costs about as much per token (serve/engine/prefill_chunk.py); an int: that many; 0: the budget
    # alone. docs/serving.md, "Prefill".
    prefill_chunk: Literal["auto"] | int = "auto"
    # Prompt rows (calls of 16+ rows) on a prompt-time form of a 4-bit artifact: its attention and gate/up linears as
    # W8A8, built from the served graph at start-up and cached (serve/runners/prompt_form.py), decode staying on
    # the 4-bit form, one K/V cache. Qwen2.5-Coder-1.5B: prompts ~1.8x faster, a second copy of those linears in
    # int8 (0.9 GB), the prompt's logits 0.94 top-1 agreement with the 4-bit graph's. "off": prompts on the served
    # form. docs/serving.md, "Prefill".
    prompt_form: Literal["off", "w8a8"] = "off"
    # Prompt coalescing (the engine's own loop; a manual-mode caller adds its requests before stepping): once
    # requests arrive within admit_quiet_ms of each other (a burst; one user alone is never held), new ones wait
    # until none has arrived for admit_quiet_ms, at most admit_max_delay_ms after the oldest, so the burst runs as
    # one batched prompt call instead of a call per few requests (each call reads every weight once). Not held
    # when the waiting prompts already fill the free rows or the token budget. 0 = admit at the next step.
    # docs/serving.md, "Prompt coalescing"; benchmarks/history.md run 11.
    admit_quiet_ms: float = Field(8.0, ge=0)
    # Longest a prompt is held for coalescing (see admit_quiet_ms).
    admit_max_delay_ms: float = Field(100.0, ge=0)
    # None = the model's max positions from the manifest (a larger value is capped to it), lowered to what the
    # KV budget holds for one sequence (logged). Set explicitly, a value the budget cannot hold fails start-up.
    max_model_len: int | None = Field(None, ge=2)
    # Requests waiting for a row before new ones get 429. Above max_batch_size: a whole batch of users answered at
    # once comes back at once, and with 64 of each, a wave at 64 users was shed while it queued (run 11).
    max_waiting: int = Field(256, ge=1)
    # A request waiting longer than this for a row is admitted before any newer one (the P99 guard,
    # serve/engine/scheduler.py).
    max_wait_s: float = Field(2.0, gt=0)
    # Order of the waiting queue for requests younger than max_wait_s.
    scheduling_policy: Literal["fcfs", "shortest_first"] = "fcfs"
    # Answers kept for repeated identical deterministic requests (greedy or seeded), LRU; 0 = off.
    result_cache_size: int = Field(1024, ge=0)
    # How often the server reads the registry alias it follows: a rollback is live within this.
    poll_interval_s: float = Field(10.0, gt=0)
    # ONNX Runtime execution providers in order of preference; those this onnxruntime build lacks are skipped, CPU is
    # the fallback.
    providers: list[str] = Field(default_factory=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    # onnxruntime intra-op threads; 0 = onnxruntime's default (one per physical core).
    intra_op_threads: int = Field(0, ge=0)
    # How onnxruntime's intra-op threads wait for work: "during_runs" busy-waits between the ops of a step (a
    # batch-1 step is ~150 small ops: waking sleeping threads for each costs more than the op) and sleeps between
    # steps, when the HTTP event loop needs the cores; "always" (onnxruntime's own default) also spins after
    # each step; "off" never spins (best when other work shares the cores). true/false mean always/off.
    # docs/serving.md, "The event loop under bursts", and benchmarks/history.md run 8 have the figures.
    ort_spinning: Literal["off", "during_runs", "always"] = "during_runs"
    # From this many decode rows on (0 = never), a gqa step on the CPU runs as two halves at once on a second
    # session with half the threads: 5-16 % more tokens/s and 10-25 % less CPU per token at 32-64 rows on 2 cores; the
    # second session is a second copy of the weights (made at start-up when max_batch_size reaches this size; never
    # for a graph over 1 GiB of weights, serve/runners/gqa_split.SPLIT_MAX_WEIGHT_BYTES: a 4-bit 1.5B's server
    # would hold 1.8x llama.cpp's RSS, a 7B's two copies of its weights).
    # benchmarks/history.md run 10.
    decode_split_rows: int = Field(16, ge=0)
    # Where a gqa runner keeps its block pool and KV rows: "auto" = GPU memory on the CUDA EP for the CUDA form's
    # fp16 cache (quantize.target: cuda), host memory otherwise; "torch" = torch tensors on the CPU, which runs the
    # device path's code on the CPU EP (the GPU rehearsal, benchmarks/gpu_serve.py --cpu); "host" = numpy always.
    kv_store: Literal["auto", "host", "torch"] = "auto"
    # How many nice steps below the HTTP event loop the model's threads run (the engine's step loop and
    # onnxruntime's intra-op pool; Linux, 0 = same priority). The loop then gets a core as soon as it has
    # work, so /health and 429s answer in a burst; the model still takes every cycle the loop leaves
    # (serve/engine/thread_priority.py, docs/serving.md "The event loop under bursts").
    model_thread_nice: int = Field(10, ge=0, le=19)
    # Speculative decoding (docs/serving.md, "Speculative decoding"): "off"; "prompt_lookup" drafts the tokens
    # that followed the sequence's last n-gram earlier in it (no second model; pays where the answer copies the
    # prompt: code edits, quoting); any other value is the artifact folder of a draft model with the served
    # model's tokenizer (a smaller model of the family, or the pipeline's student), run greedily beside it on its
    # own KV budget. Outputs keep their meaning: greedy text is the same token for token, sampled text keeps the
    # served model's distribution (serve/engine/speculative.py). A draft head folder (compress/draft/, `kind:
    # draft_head`) drafts from the served model's own hidden state, prompt lookup first where it matches. "auto":
    # the served registry version's own drafter (its `drafter` tag, flows/draft.py) with prompt lookup, prompt
    # lookup alone without one or for a local folder; it follows the alias (a rollback brings that version's own).
    speculative: str = "off"
    # Most tokens drafted for one request per step; each request's draft length adapts below it (grows while
    # drafts are accepted, shrinks and pauses while they are not).
    speculative_tokens: int = Field(4, ge=1, le=16)
    # Draft only in steps of at most this many rows (running requests): beyond, a step is no longer bound by reading
    # the weights and checking drafts costs throughput (the measured break-even: docs/serving.md).
    speculative_max_rows: int = Field(1, ge=1)
    # Longest n-gram prompt lookup matches (it tries shorter ones down to 1 token).
    speculative_ngram: int = Field(3, ge=1, le=8)
    # The draft model's KV budget in MiB, beside kv_memory_mb.
    speculative_draft_kv_mb: int = Field(64, ge=1)
    # Run a lone decode row (one user) through the multi-row kernels that prompt chunks and drafted checks use
    # (gqa layout: its token twice as a two-position chunk, the second position discarded). On graphs with int8
    # activations (MatMulNBits accuracy_level 4) ONNX Runtime's one-row kernel rounds otherwise (Qwen2.5-Coder-1.5B
    # int4: logits differ by ~0.2), so speculation can change greedy text where two tokens nearly tie; with this on
    # it never does, for ~13 % of a lone user's tokens/s where nothing is drafted (docs/serving.md, "Speculative
    # decoding").
    uniform_kernels: bool = False
    # How the model writes tool calls (serve/api/tools.py, docs/serving-api.md "Tool calls"): "auto" reads it off
    # the chat template (hermes `<tool_call>` for Qwen2.5 / Hermes and templates that know no tools, llama3_json for
    # Llama 3.x, mistral for `[TOOL_CALLS]`); or name one.
    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    # Check every artifact file against its sha256 in the manifest before serving.
    verify_artifact: bool = True
    # How many recent TTFT / inter-token latency samples the stats snapshot keeps.
    latency_window: int = Field(2048, ge=1)
    # HTTP server (serve/api/app.py): largest accepted request body; bigger ones get 413.
    max_request_bytes: int = Field(1_048_576, ge=1024)
    # After a live swap, how long in-flight requests may keep the old model before it is shut down anyway.
    drain_timeout_s: float = Field(300.0, gt=0)
    # Environment variable holding the bearer token for /admin/*; unset or empty = admin endpoints off.
    admin_token_env: str = "COMPRESSOR_ADMIN_TOKEN"

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return renamed_keys(data, "serve")

    @field_validator("prefill_chunk")
    @classmethod
    def _chunk_not_negative(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError('"auto", 0 (the token budget alone) or a number of tokens, not a negative number')
        return v

    @field_validator("ort_spinning", mode="before")
    @classmethod
    def _spinning_from_bool(cls, v):
        return {True: "always", False: "off"}.get(v, v) if isinstance(v, bool) else v


# The sections this module reads; `python -m serve --set` refuses keys outside them, which would do nothing.
SERVER_SECTIONS = ("serve", "mlflow")


@dataclass
class ServerConfig:
    """What ``python -m serve --config X`` reads of a config file."""

    serve: ServeConfig
    mlflow: MlflowConfig


def format_errors(err: ValidationError, origin: str, prefix: tuple = ()) -> str:
    """A pydantic error as lines naming each key (dotted, from the top of the file) and what to do."""
    lines = [f"invalid configuration ({origin}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in (*prefix, *e["loc"])) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; check the spelling (docs/configuration.md lists every key)")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
            lines.append(f"  {key}: {e['msg']}{got_s}")
    return "\n".join(lines)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. --set distill.steps=10")
    key, raw = item.split("=", 1)
    # YAML parsing gives ints, floats, bools, lists ("[a, b]") and null the way a user would write them.
    value = yaml.safe_load(raw) if raw != "" else ""
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path | None) -> tuple[dict, str]:
    """The config file's top-level mapping (empty without a path) and its origin for error messages."""
    if path is None:
        return {}, "defaults"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found; pass a path such as configs/default.yaml")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections at the top level")
    return data, str(p)


def load_serve_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ServerConfig:
    """The ``serve`` and ``mlflow`` sections of a YAML config (or the defaults), with KEY=VALUE overrides."""
    for item in overrides or []:
        section = item.split("=", 1)[0].strip().split(".")[0]
        if "=" in item and section not in SERVER_SECTIONS:
            raise ConfigError(f"override {item!r}: the server reads only the {' and '.join(SERVER_SECTIONS)} "
                              f"sections; use e.g. --set serve.max_waiting=8")
    data, origin = read_yaml(path)
    data = apply_overrides(data, overrides or [])
    sections = {}
    for name, model in (("serve", ServeConfig), ("mlflow", MlflowConfig)):
        raw = data.get(name) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"invalid configuration ({origin}):\n  {name}: must be a mapping of keys")
        try:
            sections[name] = model.model_validate(raw)
        except ValidationError as e:
            raise ConfigError(format_errors(e, origin, (name,))) from None
    return ServerConfig(**sections)


def project_root() -> Path:
    """The checkout (or install prefix) holding serve/ and compress/: where mlruns/ and configs/ live."""
    return Path(__file__).resolve().parent.parent
