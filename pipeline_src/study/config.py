"""Load and validate a study's params file, and resolve base ⊕ cell configs.

Config flows one way: params file -> `load_study()` -> frozen dataclasses -> stage.
No other module reads the params file. Every error is a `ConfigError` whose message
is one line naming the offending key, raised before any stage writes anything.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..common import ConfigError  # noqa: F401  (raised here; re-exported for callers)

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "params.schema.yaml"
# libyaml's parser where PyYAML has it: the same documents about 8x faster, which every stage
# pays when it reads its params file and the schema.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
NAME_RE = re.compile(r"^[a-z0-9_-]+$")
SPLITS = ("train", "validation", "test")


BASE_FILTER_VARIANT = "default"  # the task's own filter settings (no cell override)


# ---------------------------------------------------------------------------------------------
# Defaults. A task's model/train/eval sections override these; a cell overrides the task's.
# The model defaults are the paper's base model (Vaswani et al. 2017, Table 3 "base").

MODEL_DEFAULTS: dict[str, Any] = dict(
    arch="encoder_decoder", d_model=512, n_heads=8, enc_layers=6, dec_layers=6, d_ff=2048,
    dropout=0.1, attention_dropout=0.0, pos_encoding="sinusoidal", max_len=1024, residual=True,
    norm="post", activation="relu", tie_embeddings=True, copy_attention=False, attention_impl="sdpa", residual_dtype="float32",
    embed_init="normal",
)


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 100_000
    max_epochs: int | None = None
    time_budget_s: float | None = None
    # A budget in target (loss-bearing) tokens: a decoder-only translation cell, whose batches
    # hold the source too, sees as many target tokens as the encoder-decoder it is compared with.
    max_target_tokens: int | None = None
    data_order: int = 0  # k > 0: another batch order than the seed's, same initialisation
    # The peak lr chosen on validation from this grid by short trial runs (tune stage) before
    # the cell's runs; `lr` is then ignored. lr_tune_steps: the trials' length (max_steps if null).
    lr_grid: tuple[float, ...] | None = None
    lr_tune_steps: int | None = None
    batch_tokens: int = 4096
    grad_accum: int = 1
    lr: float = 7e-4  # peak learning rate (reached at the end of warm-up)
    schedule: str = "inverse_sqrt"
    warmup_steps: int = 4000
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float | None = 1.0
    eval_every: int = 1000
    patience: int = 0  # evaluations without improvement before stopping; 0 = never stop early
    max_src_len: int = 256
    max_tgt_len: int = 256
    lm_seq_len: int = 128
    precision: str = "auto"  # auto = bf16 autocast on CUDA and on CPUs with bf16 units, else fp32 (train/precision.py)
    compile: bool = False
    # compile applies on CUDA; on a CPU only with compile_on_cpu (inductor's C++ kernels round
    # differently from eager ones, so a CPU study's numbers change with it).
    compile_on_cpu: bool = False
    average_last: int = 0  # average the last N saved checkpoints into the final model
    log_every: int = 10  # also how often the step's loss and grad norm are read back (a host sync)
    # Speed. length_buckets N > 0: static batch shapes, lengths rounded up to a grid of
    # N lengths per doubling (batching.seq2seq_bucket_batches); 0 = token-budget batches of any shape.
    length_buckets: int = 0
    prefetch: bool | None = None  # collate batches in a background thread; null = on for CUDA only
    # With compile on CUDA: replay each static batch shape's compiled step as a CUDA graph
    # (torch.compile mode "reduce-overhead"); needs length_buckets for seq2seq tasks.
    cuda_graphs: bool = False
    # What compile compiles (pipeline_src/train/compiling.py): "layers" = one encoder and one decoder
    # layer, reused by every layer of a stack (short warm-up); "model" = the whole graph.
    compile_scope: str = "layers"
    # null = torch's automatic dynamic shapes (two compilations per region, whatever the number
    # of batch shapes); false = one static compilation per shape.
    compile_dynamic: bool | None = None


@dataclass(frozen=True)
class EvalConfig:
    beam_size: int = 4
    length_penalty: float = 0.6
    max_len_a: float = 1.2
    max_len_b: int = 10
    batch_size: int = 64
    max_examples: int | None = None
    n_samples: int = 5
    bootstrap: int = 1000
    # n >= 2: no hypothesis repeats an n-gram of subword tokens (3 = the trigram blocking common for
    # summaries); 0: off. Decoded on the host (the static beam search does not implement it).
    no_repeat_ngram: int = 0
    # Beam search implementation (same hypotheses): host = decode.beam_search, which drops finished
    # sentences (best on a CPU); static = evaluate/static_decode.py (fixed shapes, no host reads per step);
    # graphs = static with the decoder step replayed as a CUDA graph (CUDA only, else static);
    # auto = host (static and graphs are tested on CPU but not yet measured on a GPU).
    decoding: str = "auto"
    # lm tasks: perplexity is scored in windows of train.lm_seq_len tokens advanced by lm_stride
    # tokens, each window scoring only the tokens no earlier one scored (evaluate.lm_score_windows):
    # after the first window every token is predicted from at least lm_seq_len - lm_stride + 1
    # tokens. Non-overlapping windows (lm_stride = lm_seq_len) give a token half a window on
    # average: a higher perplexity than published ones, and short-context predictions weigh in
    # every comparison of positional encodings.
    # null: lm_seq_len // 2 (resolved per cell, as the cell's lm_seq_len may differ).
    lm_stride: int | None = None


@dataclass(frozen=True)
class FilterConfig:
    unit: str = "words"
    min_src_len: int = 1
    max_src_len: int | None = None
    min_tgt_len: int = 1
    max_tgt_len: int | None = None
    max_ratio: float | None = None
    drop_empty: bool = True
    drop_headings: bool = False  # WikiText ` = Heading = ` lines, train (splits_to_filter) only
    dedup: bool = True
    sample_fraction: float = 1.0
    sample_size: int | None = None
    sample_seed: int = 0
    splits_to_filter: tuple[str, ...] = ("train",)
    # {validation: N, test: N}: a uniform random subset of that many rows of an evaluation split
    # (kept in corpus order; the same rows for every cell and for Lead-3), for splits too large to
    # evaluate in the time at hand. Not for lm tasks, whose splits are evaluated whole.
    sample_eval: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BpeConfig:
    vocab_size: int = 8000
    model_type: str = "bpe"  # SentencePiece model type: bpe | unigram | char | word
    character_coverage: float = 1.0
    max_sentences: int = 1_000_000
    max_src_tokens: int | None = None
    max_tgt_tokens: int | None = None


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    kind: str
    hf_id: str | None = None
    hf_config: str | None = None
    hf_revision: str | None = None    # e.g. refs/convert/parquet: the Hub's Parquet export
    hf_data_dir: str | None = None    # a subfolder of the repo (in the Parquet export: the config)
    generator: str | None = None
    generator_rows: dict = field(default_factory=lambda: {"train": 2000, "validation": 200, "test": 200})
    generator_seed: int = 0
    splits: dict = field(default_factory=lambda: {s: s for s in SPLITS})
    fields: dict = field(default_factory=dict)
    text_format: str = "plain"
    processing: str = ""  # e.g. "tokenised and lower-cased (See et al. 2017)": printed beside its scores
    # lm only: the published per-word count of a split (whitespace tokens + one <eos> per line),
    # checked against the raw split at download, e.g. {test: 245569} for WikiText-2.
    expected_words: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TaskConfig:
    name: str
    kind: str
    dataset: str
    cells: tuple[str, ...]
    baseline_cell: str
    filter: FilterConfig
    bpe: BpeConfig
    model: dict  # partial model config (defaults applied in `Study.cell`)
    train: dict
    eval: dict
    source: str | None = None  # a screening stage's task: the params task it copies (tasks.<source>)
    screen: str | None = None  # ... and its screening entry (screening.<screen>)
    stage: int = 0  # 1 or 2 for a screening stage's task


@dataclass(frozen=True)
class ScreenConfig:
    """Two-stage screening of one task (params `screening.<name>`). Stage one trains every cell
    on a subset (task `<name>-s1`); a `promote` job ranks the families on it; stage two (task
    `<name>-s2`) trains on the full data the baseline and the cells of the promoted families only.
    Stage two is the screened task's own data and settings, so it shares that task's data jobs,
    and a cell the task's own grid trains is that run, not a second copy (Study.run_task)."""
    name: str
    task: str
    cells: tuple[str, ...]
    top_k: int | None
    max_p: float | None

    @property
    def stage_tasks(self) -> tuple[str, str]:
        return f"{self.name}-s1", f"{self.name}-s2"


@dataclass(frozen=True)
class CellConfig:
    """Everything one training/evaluation job needs: task base ⊕ cell overrides, resolved."""
    task: str
    kind: str
    cell: str
    family: str
    label: str
    model: dict  # all ModelConfig fields except vocab_size and special ids
    train: TrainConfig
    eval: EvalConfig
    # The data variant the cell trains on (see Study.data_variant): its filtered set and its
    # tokenizer. Cells with the same effective filter/bpe settings share both.
    filter_variant: str = BASE_FILTER_VARIANT
    bpe_variant: str = ""

    @property
    def leaks_future(self) -> bool:
        # A bidirectional encoder used as a language model sees the token it predicts.
        return self.kind == "lm" and self.model["arch"] == "encoder_only"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Study:
    path: str
    name: str
    raw: dict  # the validated params file as loaded (for provenance and DVC param keys)
    mirror: str | None
    device: str
    seeds: tuple[int, ...]
    datasets: dict[str, DatasetConfig]
    tasks: dict[str, TaskConfig]  # enabled tasks only, in file order
    cells: dict[str, dict]
    report: dict
    claims: tuple = ()      # claims_config.Claim, from the `claims:` section
    references: tuple = ()  # claims_config.Reference, from the `references:` section
    screens: dict[str, ScreenConfig] = field(default_factory=dict)
    screen_tasks: dict[str, TaskConfig] = field(default_factory=dict)  # the screening stages' tasks
    # Where each cell is written in the params file: `cells.<name>`, or `sweeps.<sweep>` for a cell
    # a sweep generates (its DVC params key and its Snakemake rerun trigger).
    cell_keys: dict[str, str] = field(default_factory=dict)
    # The seeds every cell runs; `seeds` are all the seeds a cell may run. They differ only with
    # adaptive seeds (params `seeds: {min, max}`), where the plan stage gives the cells of
    # unsettled claim comparisons the seeds beyond first_seeds (seed_plan.py).
    first_seeds: tuple[int, ...] = ()

    @property
    def adaptive_seeds(self) -> bool:
        return len(self.seeds) > len(self.first_seeds)

    def cell_key(self, cell: str) -> str:
        return self.cell_keys.get(cell, f"cells.{cell}")

    def cell_where(self, cell: str) -> str:
        """The cell's place in the params file, for error messages."""
        return f"{self.cell_keys[cell]} (cell {cell})" if cell in self.cell_keys else f"cells.{cell}"

    def task(self, name: str) -> TaskConfig:
        """A task of the study or of a screening stage."""
        return self.tasks[name] if name in self.tasks else self.screen_tasks[name]

    @property
    def all_tasks(self) -> dict[str, TaskConfig]:
        return {**self.tasks, **self.screen_tasks}

    def cell(self, task: str, cell: str) -> CellConfig:
        return _resolve_cell(self, task, cell)

    def run_task(self, task: str, cell: str) -> str:
        """The task under which the run of `task`/`cell` lives: a stage-two cell that the screened
        task's own grid also trains is that same run (same data, settings and seeds), so it is
        trained once and read from there; every other run is its own task's."""
        spec = self.task(task)
        return spec.source if spec.stage == 2 and cell in self.tasks[spec.source].cells else task

    def own_cells(self, task: str) -> tuple[str, ...]:
        """The cells `task` trains itself (see run_task)."""
        return tuple(c for c in self.task(task).cells if self.run_task(task, c) == task)

    def data_task(self, task: str) -> str:
        """The task whose filter/bpe jobs make `task`'s data: its own, except stage two of a
        screening, which is the screened task's data."""
        spec = self.task(task)
        return spec.source if spec.stage == 2 else task

    def data_cells(self, task: str) -> tuple[str, ...]:
        """The cells whose data variants `task`'s filter/bpe jobs make: its own cells and, for a
        screened task, the stage-two cells it does not train itself."""
        if self.data_task(task) != task:
            return ()
        extra = [c for other in self.screen_tasks.values() if other.stage == 2 and other.source == task
                 for c in self.own_cells(other.name)]
        return tuple(dict.fromkeys(self.task(task).cells + tuple(extra)))

    def data_variant(self, task: str, cell: str) -> tuple[str, str]:
        """(filter_variant, bpe_variant) of a cell: readable names derived from the cell's
        effective filter/bpe settings, so cells with equal settings share one filtered set and
        one tokenizer, and the DAG forks at the earliest data stage a cell changes."""
        return _data_variant(self, task, cell)[:2]

    def filter_config(self, task: str, filter_variant: str) -> FilterConfig:
        task = self.data_task(task)
        for cell in self.data_cells(task):
            v = _data_variant(self, task, cell)
            if v[0] == filter_variant:
                return v[2]
        if filter_variant == BASE_FILTER_VARIANT:
            return self.task(task).filter
        raise ConfigError(f"{self.path}: tasks.{task}: no cell uses filter variant {filter_variant!r} "
                          f"(known: {', '.join(self.data_variants(task)[0])})")

    def bpe_config(self, task: str, filter_variant: str, bpe_variant: str) -> BpeConfig:
        task = self.data_task(task)
        for cell in self.data_cells(task):
            v = _data_variant(self, task, cell)
            if v[:2] == (filter_variant, bpe_variant):
                return v[3]
        raise ConfigError(f"{self.path}: tasks.{task}: no cell uses data variant {filter_variant}/{bpe_variant}")

    def data_variants(self, task: str) -> tuple[list[str], list[tuple[str, str]]]:
        """Filter variants and (filter, tokenizer) variants of a task, in order of first use."""
        pairs = list(dict.fromkeys(self.data_variant(task, c) for c in self.data_cells(task)))
        return list(dict.fromkeys(filter_variant for filter_variant, _ in pairs)), pairs

    def section_hash(self, *keys: str) -> str:
        """Stable hash of the params sections a job reads (the Snakemake rerun trigger)."""
        values = {k: lookup(self.raw, k) for k in keys}
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def lookup(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


# ---------------------------------------------------------------------------------------------
# Data variants: a cell's `filter`/`bpe` overrides, named by what they change.


def _value_name(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "_".join(_value_name(x) for x in v)
    return str(v).replace(".", "p").replace("-", "m").lower()


def _diff_name(diff: dict) -> str:
    """key-value pairs of the changed settings, e.g. `sample_fraction-0p3`; names that would be
    unreadable or not a valid path component get a content hash instead of being truncated."""
    name = "-".join(f"{k}-{_value_name(v)}" for k, v in sorted(diff.items()))
    if not NAME_RE.match(name) or len(name) > 60:
        digest = hashlib.sha256(json.dumps(diff, sort_keys=True, default=str).encode()).hexdigest()[:10]
        name = re.sub(r"[^a-z0-9_-]", "", name)[:40].rstrip("-") + "-" + digest
    return name


def tokenizer_name(cfg: BpeConfig) -> str:
    """char, word<vocab>, bpe<vocab>, unigram<vocab>: what a tokenizer is, for paths and tables."""
    return "char" if cfg.model_type == "char" else f"{cfg.model_type}{cfg.vocab_size}"


def _data_variant(study: Study, task_name: str, cell_name: str):
    task = study.task(task_name)
    cell = study.cells[cell_name]
    base_f, base_b = dataclasses.asdict(task.filter), dataclasses.asdict(task.bpe)
    filt = _merge(base_f, cell.get("filter", {}))
    if "splits_to_filter" in filt:
        filt["splits_to_filter"] = tuple(filt["splits_to_filter"])
    bpe = _merge(base_b, cell.get("bpe", {}))
    fdiff = {k: v for k, v in filt.items() if v != base_f[k]}
    filter_variant = BASE_FILTER_VARIANT if not fdiff else _diff_name(fdiff)
    bpe_cfg = BpeConfig(**bpe)
    # The tokenizer variant always names the tokenizer (model type and size), plus any other
    # bpe setting the cell changes. It lives under its filter variant's directory.
    named = ("model_type",) if bpe_cfg.model_type == "char" else ("model_type", "vocab_size")
    bdiff = {k: v for k, v in bpe.items() if v != base_b[k] and k not in named}
    bpe_variant = tokenizer_name(bpe_cfg) + ("-" + _diff_name(bdiff) if bdiff else "")
    return filter_variant, bpe_variant, FilterConfig(**filt), bpe_cfg


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def read_yaml(text: str):
    """yaml.safe_load, with libyaml's parser where PyYAML has it."""
    return yaml.load(text, Loader=YAML_LOADER)


@functools.lru_cache(maxsize=None)
def _schema() -> dict:
    return read_yaml(SCHEMA_PATH.read_text())


@functools.lru_cache(maxsize=None)
def _validator(part: str = ""):
    """The params schema's validator, or (part="cell") that of one entry of `cells:`, which
    checks the cells a sweep generates."""
    import jsonschema

    schema = _schema()
    if part == "cell":
        schema = dict(schema["properties"]["cells"]["additionalProperties"], **{"$defs": schema["$defs"]})
    return jsonschema.Draft202012Validator(schema)


def _schema_errors(raw: dict, where: str, part: str = "") -> None:
    """Raise the first schema error of `raw` (the params file, or one generated cell) as one line."""
    errors = sorted(_validator(part).iter_errors(raw),
                    key=lambda e: (len(list(e.absolute_path)), list(map(str, e.absolute_path))))
    if not errors:
        return
    err = errors[0]
    # Under oneOf/anyOf (e.g. seeds: a list or {min, max}), the alternative the value was
    # meant as names the key: the deepest error that is not just "wrong type".
    while err.validator in ("oneOf", "anyOf") and err.context:
        meant = [e for e in err.context if e.validator != "type"] or list(err.context)
        err = max(meant, key=lambda e: len(list(e.absolute_path)))
    path = list(err.absolute_path)
    if err.validator == "additionalProperties":
        patterns = [re.compile(p) for p in err.schema.get("patternProperties", {})]
        extra = sorted(k for k in set(err.instance) - set(err.schema.get("properties", {}))
                       if not any(p.search(k) for p in patterns))
        if len(path) == 2 and path[0] == "sweeps" and extra and "." in extra[0]:  # the flat form: model.n_heads
            section, setting = extra[0].split(".", 1)
            raise ConfigError(f"{where}: {_key(path)}: {extra[0]!r}: write it nested, {section}: {{{setting}: [...]}} "
                              "(dvc exp run -S reads a dot as nesting)")
        raise ConfigError(f"{where}: {_key(path + extra[:1])}: unknown key")
    if err.validator == "required":
        missing = err.message.split("'")[1] if "'" in err.message else "?"
        raise ConfigError(f"{where}: {_key(path + [missing])}: required key is missing")
    if err.validator == "propertyNames":
        raise ConfigError(f"{where}: {_key(path)}: name {err.instance!r} must match [a-z0-9_-]+")
    if err.validator == "pattern":
        raise ConfigError(f"{where}: {_key(path)}: {err.instance!r} must match [a-z0-9_-]+")
    message = err.message.replace("\n", " ")
    if len(message) > 160:
        message = message[:157] + "..."
    raise ConfigError(f"{where}: {_key(path)}: {message}")


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (override or {}).items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _check_model(model: dict, kind: str, where: str) -> None:
    if model["d_model"] % model["n_heads"]:
        raise ConfigError(
            f"{where}.d_model: {model['d_model']} is not divisible by n_heads={model['n_heads']}")
    if model["pos_encoding"] == "rope" and (model["d_model"] // model["n_heads"]) % 2:
        raise ConfigError(f"{where}.pos_encoding: rope needs an even head size (d_model/n_heads)")
    arch = model["arch"]
    allowed = {"lm": ("decoder_only", "encoder_only")}.get(kind, ("encoder_decoder", "decoder_only"))
    if arch not in allowed:
        raise ConfigError(
            f"{where}.arch: {arch} makes no sense for a {kind} task (allowed: {', '.join(allowed)})")
    if arch in ("encoder_decoder", "encoder_only") and model["enc_layers"] < 1:
        raise ConfigError(f"{where}.enc_layers: {arch} needs at least one encoder layer")
    if arch in ("encoder_decoder", "decoder_only") and model["dec_layers"] < 1:
        raise ConfigError(f"{where}.dec_layers: {arch} needs at least one decoder layer")


def _resolve_cell(study: Study, task_name: str, cell_name: str) -> CellConfig:
    task = study.task(task_name)
    cell = study.cells[cell_name]
    where = f"{study.cell_where(cell_name)} (task {task_name})"
    model = _merge(_merge(MODEL_DEFAULTS, task.model), cell.get("model", {}))
    _check_model(model, task.kind, f"{study.path}: {where}: model")
    train = _merge(task.train, cell.get("train", {}))
    if train.get("cuda_graphs") and not (train.get("compile") and (train.get("length_buckets") or task.kind == "lm")):
        raise ConfigError(f"{study.path}: {where}: train.cuda_graphs: needs train.compile: true"
                          f"{'' if task.kind == 'lm' else ' and train.length_buckets > 0'} (one graph per static batch shape)")
    for key in ("betas", "lr_grid"):
        if train.get(key) is not None:
            train[key] = tuple(train[key])
    train_cfg = TrainConfig(**train)
    ev = _merge(task.eval, cell.get("eval", {}))
    key = (f"{study.path}: {where}: eval.lm_stride" if "lm_stride" in cell.get("eval", {})
           else f"{study.path}: tasks.{task.source or task_name}.eval.lm_stride (cell {cell_name})")
    ev["lm_stride"] = _lm_stride(ev.get("lm_stride"), task.kind, train_cfg.lm_seq_len, key)
    filter_variant, bpe_variant, _, _ = _data_variant(study, task_name, cell_name)
    return CellConfig(
        task=task_name, kind=task.kind, cell=cell_name, family=cell["family"],
        label=cell.get("label", cell_name), model=model,
        train=train_cfg, eval=EvalConfig(**ev), filter_variant=filter_variant, bpe_variant=bpe_variant)


def _lm_stride(stride: int | None, kind: str, window: int, key: str) -> int | None:
    """eval.lm_stride as the cell evaluates with it (None for a task that is not lm)."""
    if kind != "lm":
        if stride is not None:
            raise ConfigError(f"{key}: only applies to a language-modelling (kind: lm) task, this one is {kind}")
        return None
    if stride is None:
        return max(1, window // 2)
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
        raise ConfigError(f"{key}: {stride!r} must be a whole number of tokens from 1 to train.lm_seq_len {window} "
                          f"(the window it advances; {window} = non-overlapping windows)")
    return stride


def _screening(raw: dict, tasks: dict, cells: dict, where: str, sweeps: dict[str, list[str]]):
    """`screening:` entries -> ScreenConfigs and the two stage tasks of each: copies of the
    screened task with the screening's cells (the first is the baseline); stage one's filter/bpe/
    train sections are the task's with `stage_one`'s merged over them."""
    screens, stage_tasks = {}, {}
    for name, s in (raw.get("screening") or {}).items():
        key = f"screening.{name}"
        if s["task"] not in tasks:
            raise ConfigError(f"{where}: {key}.task: {s['task']!r} is not an enabled task")
        s = dict(s, cells=_expand_names(s["cells"], sweeps))
        for c in s["cells"]:
            if c not in cells:
                raise ConfigError(f"{where}: {key}.cells: unknown cell {c!r} (define it under cells or sweeps)")
        base = tasks[s["task"]]
        screen = ScreenConfig(name=name, task=s["task"], cells=tuple(s["cells"]), top_k=s["promote"].get("top_k"),
                              max_p=s["promote"].get("max_p"))
        for stage, tname in zip((1, 2), screen.stage_tasks):
            if tname in tasks:
                raise ConfigError(f"{where}: {key}: task name {tname!r} (its stage {stage}) is already a task")
            filt, bpe, train = dataclasses.asdict(base.filter), dataclasses.asdict(base.bpe), base.train
            if stage == 1:  # a quick screen: less data, optionally shorter training
                filt = _merge(filt, s["stage_one"].get("filter", {}))
                bpe = _merge(bpe, s["stage_one"].get("bpe", {}))
                train = _merge(train, s["stage_one"].get("train", {}))
            filt["splits_to_filter"] = tuple(filt["splits_to_filter"])
            stage_tasks[tname] = dataclasses.replace(
                base, name=tname, cells=screen.cells, baseline_cell=screen.cells[0], filter=FilterConfig(**filt),
                bpe=BpeConfig(**bpe), train=train, source=base.name, screen=name, stage=stage)
        screens[name] = screen
    return screens, stage_tasks


# ---------------------------------------------------------------------------------------------
# Sweeps: a family written in one line, expanded into named cells.

SWEEP_OPTIONS = ("family", "label", "name")


def _sweep_value_name(v) -> str:
    """1 -> 1, 0.1 -> 0p1, 0.0 -> 0, 1e-4 -> 0p0001, True -> true: valid in a cell name."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        v = f"{v:.10f}".rstrip("0").rstrip(".")
    return str(v).replace(".", "p").replace("-", "m").lower()


def expand_sweeps(raw: dict, where: str) -> dict[str, tuple[str, dict]]:
    """`sweeps:` -> {cell name: (sweep name, cell dict)}, one cell per value of the axis, or per
    combination of values for several axes (their product, in file order). Settings are nested
    under their section, as in a cell (`model: {n_heads: [1, 2, 4]}`), so that DVC addresses
    each one (`dvc exp run -S sweeps.heads.model.n_heads=...`): a list is an axis, a single
    value a setting every cell of the sweep shares. A cell is named `<sweep>_<value>[_<value>...]`
    (axes only) unless the sweep gives a `name` template; its label is `<setting> <value>, ...`
    unless it gives a `label` template. Templates use the settings' names, e.g. "{n_heads} heads"."""
    import itertools

    out: dict[str, tuple[str, dict]] = {}
    for sweep, spec in (raw.get("sweeps") or {}).items():
        key = f"sweeps.{sweep}"
        settings = {f"{section}.{setting}": v for section, body in spec.items() if section not in SWEEP_OPTIONS
                    for setting, v in body.items()}
        axes = {k: v for k, v in settings.items() if isinstance(v, list)}
        if not axes:
            raise ConfigError(f"{where}: {key}: no axis to sweep (a list of values, e.g. model: {{n_heads: [1, 2, 4]}})")
        leaves = [a.split(".", 1)[1] for a in settings]
        if len(set(leaves)) < len(leaves):
            raise ConfigError(f"{where}: {key}: two settings have the same name ({', '.join(leaves)})")
        if sweep in raw["cells"]:
            raise ConfigError(f"{where}: {key}: {sweep!r} is also a cell name (a task's cells list would be ambiguous)")
        for values in itertools.product(*axes.values()):
            chosen = {**settings, **dict(zip(axes, values))}  # in file order
            fields = {k.split(".", 1)[1]: v for k, v in chosen.items()}
            try:
                name = (spec["name"].format(**fields) if "name" in spec
                        else "_".join([sweep] + [_sweep_value_name(v) for v in values]))
                label = (spec["label"].format(**fields) if "label" in spec
                         else ", ".join(f"{a.split('.', 1)[1]} {v}" for a, v in zip(axes, values)))
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError(f"{where}: {key}: bad name/label template ({type(e).__name__}: {e}); "
                                  f"use the settings' names: {', '.join('{' + f + '}' for f in leaves)}") from None
            if not NAME_RE.match(name):
                raise ConfigError(f"{where}: {key}: cell name {name!r} must match [a-z0-9_-]+ (give a name template)")
            if name in raw["cells"] or name in out:
                raise ConfigError(f"{where}: {key}: cell name {name!r} is already "
                                  f"{'a cell under cells' if name in raw['cells'] else 'made by sweeps.' + out[name][0]}")
            cell: dict = {"family": spec.get("family", sweep), "label": label}
            for axis, value in chosen.items():
                section, setting = axis.split(".", 1)
                cell.setdefault(section, {})[setting] = value
            _schema_errors(cell, f"{where}: {key}: {name}", part="cell")
            out[name] = (sweep, cell)
    return out


def _expand_names(names, sweeps: dict[str, list[str]]) -> tuple[str, ...]:
    """A task's or a screening's cells list, where a sweep's name stands for all of its cells."""
    return tuple(dict.fromkeys(c for n in names for c in sweeps.get(n, [n])))


def _seeds(spec, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(every seed a cell may run, the seeds every cell runs) of `seeds:`."""
    if isinstance(spec, list):
        return tuple(spec), tuple(spec)
    if spec["min"] < 3:
        raise ConfigError(f"{where}: seeds.min: {spec['min']} runs per cell cannot settle anything; the seed-level "
                          "test needs >= 3 (report/stats.py MIN_RUNS)")
    if spec["max"] < spec["min"]:
        raise ConfigError(f"{where}: seeds.max: {spec['max']} is below seeds.min {spec['min']}")
    return tuple(range(spec["max"])), tuple(range(spec["min"]))


def load_study(path: str | Path) -> Study:
    """Read, validate and freeze a params file. Raises ConfigError (one line) on any problem."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: params file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 (byte {e.start})") from None
    try:
        raw = read_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{where}:{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: <top level>: must be a mapping of keys")
    _schema_errors(raw, where)

    datasets = {}
    for name, d in raw["datasets"].items():
        src = "generator" if d.get("generator") else "hf_id" if d.get("hf_id") else None
        if src is None:
            raise ConfigError(f"{where}: datasets.{name}: needs either hf_id or generator")
        need = ("text",) if d["kind"] == "lm" else ("src", "tgt")
        if src == "hf_id":
            for f in need:
                if f not in d.get("fields", {}):
                    raise ConfigError(f"{where}: datasets.{name}.fields.{f}: required for a {d['kind']} dataset")
        datasets[name] = DatasetConfig(name=name, **{k: v for k, v in d.items()})

    swept = expand_sweeps(raw, where)
    cells = {**raw["cells"], **{name: cell for name, (_, cell) in swept.items()}}
    cell_keys = {name: f"sweeps.{sweep}" for name, (sweep, _) in swept.items()}
    by_sweep: dict[str, list[str]] = {}
    for name, (sweep, _) in swept.items():
        by_sweep.setdefault(sweep, []).append(name)
    tasks = {}
    for name, spec in raw["tasks"].items():
        spec = dict(spec, cells=_expand_names(spec["cells"], by_sweep))
        if spec["dataset"] not in datasets:
            raise ConfigError(f"{where}: tasks.{name}.dataset: unknown dataset {spec['dataset']!r}")
        if datasets[spec["dataset"]].kind != spec["kind"]:
            raise ConfigError(
                f"{where}: tasks.{name}.kind: {spec['kind']} but dataset {spec['dataset']} is {datasets[spec['dataset']].kind}")
        for c in spec["cells"]:
            if c not in cells:
                raise ConfigError(f"{where}: tasks.{name}.cells: unknown cell {c!r} (define it under cells or sweeps)")
        baseline = spec.get("baseline_cell", spec["cells"][0])
        if baseline not in spec["cells"]:
            raise ConfigError(f"{where}: tasks.{name}.baseline_cell: {baseline!r} is not in the task's cells")
        filt = dict(spec.get("filter", {}))
        if "splits_to_filter" in filt:
            filt["splits_to_filter"] = tuple(filt["splits_to_filter"])
        if spec.get("enabled", True):
            tasks[name] = TaskConfig(
                name=name, kind=spec["kind"], dataset=spec["dataset"], cells=tuple(spec["cells"]),
                baseline_cell=baseline, filter=FilterConfig(**filt), bpe=BpeConfig(**spec.get("bpe", {})),
                model=spec.get("model", {}), train=spec.get("train", {}), eval=spec.get("eval", {}))
    if not tasks:
        raise ConfigError(f"{where}: tasks: every task is disabled (enabled: false); nothing to run")

    sample_task = (raw.get("report") or {}).get("attention_sample_task")
    if sample_task is not None and sample_task not in tasks:
        raise ConfigError(f"{where}: report.attention_sample_task: {sample_task!r} is not an enabled task")
    screens, screen_tasks = _screening(raw, tasks, cells, where, by_sweep)
    seeds, first_seeds = _seeds(raw["seeds"], where)
    study = Study(
        path=where, name=raw["study"], raw=raw, mirror=raw.get("mirror"), device=raw.get("device", "auto"),
        seeds=seeds, first_seeds=first_seeds, datasets=datasets, tasks=tasks, cells=cells, report=raw.get("report", {}),
        screens=screens, screen_tasks=screen_tasks, cell_keys=cell_keys)
    for name, task in study.all_tasks.items():
        for c in task.cells:  # resolve every cell now, so a bad combination fails before any stage runs
            study.cell(name, c)
    check_consistency(study)
    from .claims_config import parse_claims, parse_references
    study = dataclasses.replace(study, claims=parse_claims(raw, tasks, where),
                                references=parse_references(raw, tasks, where))
    return study


# ---------------------------------------------------------------------------------------------
# Cross-field consistency: combinations the schema cannot see that would otherwise fail only at
# run time, often after download, filter and BPE have run (on a GPU study: found late).


def bucket_length(n: int, per_octave: int) -> int:
    """n rounded up to a grid with `per_octave` lengths per doubling: 1..per_octave exactly, then
    steps of 2^k / per_octave, so a row is padded by less than 1/per_octave of its length. (A
    per_octave that is not a power of two rounds the step down, to at least 1.)"""
    if n <= per_octave:
        return n
    step = max(1, 2 ** int(math.log2(n)) // per_octave)
    return -(-n // step) * step


def positions_needed(kind: str, arch: str, train: TrainConfig) -> tuple[int, str, str]:
    """(the most positions one sequence of a cell occupies, how, the keys that set it).

    Every split is cut to the train caps before the model sees it (batching.load_seq2seq: source
    to max_src_len incl. EOS, decoder input BOS + target to max_tgt_len; lm windows of lm_seq_len).
    BPE's max_*_tokens only drop long *train* rows, so validation and test rows still reach the
    train caps: the caps, not the BPE or filter limits, bound the positions."""
    if kind == "lm":
        return train.lm_seq_len, "train.lm_seq_len", "train.lm_seq_len"
    if arch == "decoder_only":  # one sequence: source + EOS, BOS, target (the input drops the last EOS)
        return (train.max_src_len + train.max_tgt_len,
                f"decoder-only reads source and target as one sequence: train.max_src_len {train.max_src_len} "
                f"+ train.max_tgt_len {train.max_tgt_len}", "train.max_src_len / train.max_tgt_len")
    key = "train.max_src_len" if train.max_src_len >= train.max_tgt_len else "train.max_tgt_len"
    return max(train.max_src_len, train.max_tgt_len), key, key


def positions_padded(kind: str, arch: str, train: TrainConfig) -> tuple[int, str, str]:
    """positions_needed, after static-shape buckets round a translation batch's width up to the
    bucket grid (batching.seq2seq_bucket_batches): a padded column still looks up a position."""
    need, how, keys = positions_needed(kind, arch, train)
    if kind == "lm" or not train.length_buckets:
        return need, how, keys
    padded = bucket_length(need, train.length_buckets)
    if padded == need:
        return need, how, keys
    return padded, f"{how}, rounded up to the bucket grid of train.length_buckets {train.length_buckets}", \
        f"{keys} or train.length_buckets"


def _check_positions(study: Study, task: str, cell: CellConfig) -> None:
    # Learned and sinusoidal tables have max_len rows: a longer sequence is an IndexError in the
    # first batch. RoPE and no encoding have no table, but max_len is still the model's declared
    # context, and a positional-encoding ablation compares cells that differ in the encoding
    # only: a cell that passed only because its encoding has no table would be the odd one out.
    # So the rule is the same for every encoding (raising max_len costs rope/none nothing).
    need, how, keys = positions_padded(cell.kind, cell.model["arch"], cell.train)
    have = cell.model["max_len"]
    if need > have:
        raise ConfigError(
            f"{study.path}: {study.cell_where(cell.cell)} (task {task}): model.max_len: {have} is below the {need} positions "
            f"a sequence may take ({how}; {cell.model['arch']}, pos_encoding {cell.model['pos_encoding']}); "
            f"raise tasks.{task}.model.max_len to {need} or lower tasks.{task}.{keys}")


def _check_dataset(where: str, ds: DatasetConfig) -> None:
    key = f"{where}: datasets.{ds.name}"
    missing = [s for s in SPLITS if s not in ds.splits]
    if missing:  # train trains, validation selects the checkpoint, test is reported: all are read
        raise ConfigError(f"{key}.splits: needs train, validation and test (missing: {', '.join(missing)})")
    if ds.generator:
        missing = [s for s in SPLITS if s not in ds.generator_rows]
        if missing:
            raise ConfigError(f"{key}.generator_rows: needs a row count for train, validation and test "
                              f"(missing: {', '.join(missing)})")
    if ds.kind != "lm" and ds.text_format == "wikitext":
        raise ConfigError(f"{key}.text_format: wikitext only applies to a language-modelling (kind: lm) dataset, "
                          f"this one is {ds.kind}")
    if ds.kind != "summarization" and ds.text_format == "tokenized":
        raise ConfigError(f"{key}.text_format: tokenized only applies to a summarization dataset (it sets how "
                          f"ROUGE-Lsum and Lead-3 split sentences), this one is {ds.kind}")
    if ds.kind != "lm":
        for k, v in (("expected_words", bool(ds.expected_words)),):
            if v:
                raise ConfigError(f"{key}.{k}: only applies to a language-modelling (kind: lm) dataset, "
                                  f"this one is {ds.kind}")


def _check_filter(where: str, task: TaskConfig, ds: DatasetConfig) -> None:
    f, key = task.filter, f"{where}: tasks.{task.name}.filter"
    for side in ("src", "tgt"):
        low, high = getattr(f, f"min_{side}_len"), getattr(f, f"max_{side}_len")
        if high is not None and low > high:
            raise ConfigError(f"{key}.min_{side}_len: {low} is above max_{side}_len {high}; "
                              f"the filter would remove every row")
    if f.drop_headings and ds.text_format != "wikitext":
        raise ConfigError(f"{key}.drop_headings: needs datasets.{ds.name}.text_format: wikitext "
                          f"(it is {ds.text_format})")
    if task.kind == "lm" and f.sample_eval:
        raise ConfigError(f"{key}.sample_eval: the evaluation splits of an lm task are evaluated whole (per-word "
                          "perplexities are published over every line); drop it")
    if task.kind == "lm":
        evaluated = [s for s in f.splits_to_filter if s != "train"]
        if evaluated:
            raise ConfigError(
                f"{key}.splits_to_filter: {', '.join(evaluated)} of an lm task cannot be filtered: validation and "
                f"test are evaluated whole, every line, as published per-word perplexities are; filter train only")


def check_consistency(study: Study) -> None:
    """Raise ConfigError (one line naming the keys) for a combination that cannot run."""
    for ds in study.datasets.values():
        _check_dataset(study.path, ds)
    for name, task in study.tasks.items():
        _check_filter(study.path, task, study.datasets[task.dataset])
        for c in task.cells:
            _check_positions(study, name, study.cell(name, c))
