"""Passkey retrieval through the quantized cache: a number hidden in filler text at several depths
of a long context, the model asked to repeat it, scored by exact greedy retrieval.

The task's form follows the passkey test of Mohtashami & Jaggi, "Landmark Attention"
(arXiv:2305.16300): an instruction, repeated filler sentences, one line that states a random
number, more filler, a question; the context is long, the needle short. The wording here is the
project's own. Each prompt is prefilled into a cache of the configuration measured (every K/V
row encoded before attention reads it, stream options calibrated on that prefill), then the
answer is decoded greedily through the same cache (the consumers); a prompt counts as retrieved
when the first number of the continuation is the passkey, digit for digit.

Run (one model, the lengths and depths given, f32 plus the frontier's picks and baselines)::

    python -m kvquant_experiments.passkey --model smollm2 --lengths 4096,8192 \\
        --choices data/results/frontier-choices.json --out data/results
    python -m kvquant_experiments.passkey --list     # the configurations only

Writes ``passkey-<model>-L<lengths>-d<depths>-s<seed>.{json,csv,md}`` into ``--out`` (default: a
folder of that name under the current directory) after every prompt, and resumes from that JSON:
a run cut short keeps what it measured. The prompts run depth by depth, every configuration at
each. Seeds and filler are fixed and recorded in the result.
"""
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

from kvquant.outputs import atomic_write
from .common import environment, safe_stem, stable_seed, write_csv, write_json
from .study import Output, add_quiet_argument, study_main

__all__ = [
    "DEFAULT_BASELINES",
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "PassPrompt",
    "Template",
    "build_prompt",
    "format_markdown",
    "main",
    "passkey_of",
    "read_answer",
    "retrieve",
    "run_passkey",
    "write_passkey",
]

DEFAULT_LENGTHS = (4096, 8192)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_SEED = 0
# What a run measures beside the picks of a choices file (f32 first: the bar).
DEFAULT_BASELINES = ("f32", "kv8", "q8_0+rot", "q4_0+rot", "tq4")
KEY_DIGITS = 5
# Digits, then room for a space before them and what follows them.
NEW_TOKENS = KEY_DIGITS + 2


@dataclass(frozen=True)
class Template:
    """The words of a passkey prompt.

    ``intro`` opens the prompt, ``filler`` sentences (cycled) fill it, ``needle`` (with
    ``{key}``) states the number and ``question`` closes the prompt, its last words leading into
    the answer.
    """
    intro: str
    needle: str
    question: str
    filler: tuple

    def check(self):
        if "{key}" not in self.needle:
            raise ValueError(f"the needle {self.needle!r} has no {{key}} to put the number in")
        if not self.filler or not all(s.strip() for s in self.filler):
            raise ValueError("a template needs at least one non-empty filler sentence")
        return self


TEMPLATE = Template(
    intro=("There is a secret number somewhere in the long text below. Read all of it and "
           "remember the number: at the end you will be asked to repeat it.\n\n"),
    needle=" The secret number is {key}. Remember it: the secret number is {key}.",
    question="\n\nWhat is the secret number? The secret number is",
    filler=(" The river runs past the old mill.", " A bell rings in the square at noon.",
            " The road bends toward the hills.", " Birds sit on the wires above the street.",
            " Then the day goes on as it did before."),
)


@dataclass(frozen=True)
class PassPrompt:
    """One prompt: token ``ids`` (BOS first when the model asks for it), the ``key``, the
    ``depth`` asked (0 = right after the intro, 1 = right before the question), where the needle
    starts in ``ids`` (``needle_start``; ``needle_tokens`` long) and the filler tokens before and
    after it."""
    ids: tuple
    key: str
    depth: float
    needle_start: int
    needle_tokens: int
    filler_before: int
    filler_after: int

    @property
    def n_tokens(self):
        return len(self.ids)

    def describe(self):
        out = asdict(self)
        out.pop("ids")
        out["n_tokens"] = self.n_tokens
        out["needle_depth"] = self.needle_start / self.n_tokens
        return out


def passkey_of(seed, n_tokens, depth, digits=KEY_DIGITS):
    """The number hidden at (``n_tokens``, ``depth``): ``digits`` digits, no leading zero, fixed
    by the parameters (:func:`~kvquant_experiments.common.stable_seed`)."""
    low = 10 ** (digits - 1)
    return str(low + stable_seed("passkey", seed, int(n_tokens), float(depth)) % (9 * low))


def build_prompt(encode, n_tokens, depth, key, template=None, bos=None):
    """A passkey prompt of at most ``n_tokens`` tokens with the needle at ``depth``.

    The parts are encoded one by one (``encode``: text -> ids, without BOS) and joined as ids,
    so that the needle's place and the count are exact; the filler is cut at sentence ends only
    (the prompt is within one filler sentence of ``n_tokens``), the needle put at the sentence
    end nearest ``depth`` of the filler.

    Parameters
    ----------
    encode : callable str -> sequence of int
    n_tokens : int
        The longest prompt, BOS included.
    depth : float in [0, 1]
    key : str
        The number (digits).
    template : Template or None
        Default :data:`TEMPLATE`.
    bos : int or None
        Prepended when given.

    Returns
    -------
    PassPrompt

    Raises
    ------
    ValueError
        A depth outside [0, 1], a key that is not digits, or ``n_tokens`` too small for the
        intro, needle and question (the message gives what they take).
    """
    template = (template or TEMPLATE).check()
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1] (a share of the filler), got {depth}")
    if not str(key).isdigit():
        raise ValueError(f"the passkey must be digits, got {key!r}")
    head = ([bos] if bos is not None else []) + list(encode(template.intro))
    needle = list(encode(template.needle.format(key=key)))
    tail = list(encode(template.question))
    room = int(n_tokens) - len(head) - len(needle) - len(tail)
    sentences = [list(encode(s)) for s in template.filler]
    if room < max(len(s) for s in sentences):
        raise ValueError(
            f"{n_tokens} tokens leave no room for filler: the intro, needle and question take "
            f"{len(head) + len(needle) + len(tail)}; ask for more tokens")
    filler, ends = [], [0]
    i = 0
    while len(filler) + len(sentences[i % len(sentences)]) <= room:
        filler += sentences[i % len(sentences)]
        ends.append(len(filler))
        i += 1
    cut = min(ends, key=lambda e: (abs(e - depth * len(filler)), e))
    ids = head + filler[:cut] + needle + filler[cut:] + tail
    return PassPrompt(ids=tuple(int(t) for t in ids), key=str(key), depth=float(depth),
                      needle_start=len(head) + cut, needle_tokens=len(needle),
                      filler_before=cut, filler_after=len(filler) - cut)


def model_prompt(model, length, depth, seed=DEFAULT_SEED, template=None):
    """The prompt of a context of ``length`` tokens: :func:`build_prompt` of at most ``length -
    NEW_TOKENS`` tokens (the answer decoded after it fits too) with ``model``'s tokenizer (its
    BOS id first) and the key of (``seed``, ``length``, ``depth``)."""
    def encode(text):
        ids = model.encode(text).tolist()
        return ids[1:] if model.bos_token_id is not None and ids[:1] == [model.bos_token_id] \
            else ids
    return build_prompt(encode, length - NEW_TOKENS, depth, passkey_of(seed, length, depth),
                        template=template, bos=model.bos_token_id)


def read_answer(text):
    """The first run of digits of a continuation (the model's answer), or None."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def retrieve(model, prompts, pair_spec, n_new=NEW_TOKENS):
    """Greedy continuations of ``prompts`` (PassPrompt), each prefilled into its own cache of
    ``pair_spec`` and decoded through it (together, one :meth:`decode_step` per token).

    Only the last position's logits are formed (a long prefill needs no n x vocab array).
    Decoding stops early once every continuation holds a whole number (digits and a character
    after them): later tokens cannot change the answer :func:`read_answer` reads.

    Returns
    -------
    list of list of int
        At most ``n_new`` token ids per prompt (all of the same length).
    """
    import numpy as np
    caches = [model.new_cache(pair_spec) for _ in prompts]
    last = np.stack([model.forward(np.asarray(p.ids), c, last_only=True)[0]
                     for p, c in zip(prompts, caches)])
    outs = [[] for _ in prompts]
    for step in range(n_new):
        nxt = last.argmax(axis=1)
        for out, t in zip(outs, nxt):
            out.append(int(t))
        # every answer complete (digits, then something else): the rest cannot change it
        if step == n_new - 1 or all(_settled(model.decode(out)) for out in outs):
            break
        last = model.decode_step(nxt, caches)
    return outs


def _settled(text):
    return re.search(r"\d+\D", text) is not None


# --------------------------------------------------------------------------------------------
# Runs and result files
# --------------------------------------------------------------------------------------------
def result_stem(meta):
    """``passkey-<model>-L<lengths>-d<depths in %, increasing>-s<seed>``."""
    from kvquant_experiments.models import model_tag
    lengths = "-".join(str(n) for n in meta["lengths"])
    depths = "-".join(f"{round(100 * d):d}" for d in sorted(meta["depths"]))
    return safe_stem(f"passkey-{model_tag(meta['model_name'])}-L{lengths}-d{depths}"
                     f"-s{meta['seed']}")


def run_passkey(model_name, configs, lengths=DEFAULT_LENGTHS, depths=DEFAULT_DEPTHS,
                seed=DEFAULT_SEED, model=None, done=None, on_prompt=None, progress=None,
                choices=None, template=None):
    """Retrieval of every (configuration, length, depth).

    Parameters
    ----------
    model_name : str
        A name or GGUF path for :func:`kvquant.models.load_model` (``model``: that model already
        built).
    configs : list of str
        Pair specs.
    done : list of dict or None
        Rows of an earlier run with the same prompts; their (config, length, depth) cells are
        kept, not measured again.
    on_prompt : callable(result) or None
        Called with the result so far after every prompt (writes the files).
    choices : dict or None
        The choices file the configurations came from (recorded).
    template : Template or None
        Default :data:`TEMPLATE` (recorded).

    Returns
    -------
    dict ``{"meta", "prompts", "rows"}``; a row per (config, length, depth): the key, the answer
    read, ``retrieved`` and the continuation's ids and text.
    """
    if model is None:
        from kvquant.models import load_model
        model = load_model(model_name)
    for n in lengths:
        if n > model.context_length:
            raise ValueError(f"{n} tokens exceed {model.name}'s trained context of "
                             f"{model.context_length}; ask for shorter lengths")
    template = template or TEMPLATE
    prompts = {n: [model_prompt(model, n, d, seed, template) for d in depths] for n in lengths}
    result = {
        "meta": {"model_name": model_name, "model": model.describe(), "lengths": list(lengths),
                 "depths": list(depths), "seed": seed, "template": asdict(template),
                 "new_tokens": NEW_TOKENS, "configs": list(configs),
                 "scoring": "retrieved: the first run of digits of the greedy continuation "
                            "equals the passkey",
                 "source": "task form of Mohtashami & Jaggi, arXiv:2305.16300; own wording",
                 "choices": choices, "environment": environment()},
        "prompts": [p.describe() for n in lengths for p in prompts[n]],
        "rows": [],
    }
    keep = {(r["codec"], r["n_tokens_asked"], r["depth"]) for r in (done or [])}
    result["rows"] = list(done or [])
    # depth by depth, every configuration at each: a run cut short compares them on the same
    # prompts
    for n in lengths:
        for p in prompts[n]:
            for spec in configs:
                if (spec, n, p.depth) in keep:
                    continue
                t0 = time.perf_counter()
                out = retrieve(model, [p], spec)[0]
                text = model.decode(out)
                answer = read_answer(text)
                result["rows"].append({
                    "codec": spec, "n_tokens_asked": n, "n_tokens": p.n_tokens,
                    "depth": p.depth, "needle_start": p.needle_start, "key": p.key,
                    "answer": answer, "retrieved": answer == p.key, "continuation": text,
                    "continuation_ids": out, "wall_s": time.perf_counter() - t0})
                if progress:
                    progress(f"{spec} at {n} tokens, depth {p.depth:g}: "
                             f"{'retrieved' if answer == p.key else 'missed'} ({answer!r} for "
                             f"{p.key}, {time.perf_counter() - t0:.0f} s)")
                if on_prompt:
                    on_prompt(result)
    return result


CSV_COLUMNS = ["codec", "n_tokens_asked", "n_tokens", "depth", "needle_start", "key", "answer",
               "retrieved", "continuation", "wall_s"]


def summary(result):
    """{(codec, n_tokens_asked): (retrieved, asked, depths missed)} in the order of the run."""
    out = {}
    for r in result["rows"]:
        hit, n, missed = out.get((r["codec"], r["n_tokens_asked"]), (0, 0, []))
        out[(r["codec"], r["n_tokens_asked"])] = (
            hit + r["retrieved"], n + 1, missed + ([] if r["retrieved"] else [r["depth"]]))
    return out


def format_markdown(result):
    """Retrieved / asked per configuration and length, depths missed, against f32's."""
    meta = result["meta"]
    s = summary(result)
    lengths = meta["lengths"]
    picks = {}
    for budget, pick in (meta.get("choices") or {}).items():
        picks.setdefault(pick["pair"], []).append(budget)
    depths = ", ".join(f"{round(100 * d)}%" for d in sorted(meta["depths"]))
    lines = [
        f"{meta['model']['model']}: passkey retrieval ({KEY_DIGITS}-digit number, greedy "
        f"decoding through the cache), contexts of {', '.join(str(n) for n in lengths)} tokens "
        f"(prompt and answer), the number at {depths} of the filler "
        f"(seed {meta['seed']}). Cells: retrieved / prompts; missed depths in brackets. "
        "Bits per value with the fixed costs of stream options spread over the longest context. "
        "'= f32': the configuration retrieves every prompt f32 retrieves.",
        "",
        "| K/V | bits/value at " + f"{max(lengths)} | "
        + " | ".join(f"{n} tokens" for n in lengths) + " | = f32 |",
        "|---|---|" + "---|" * len(lengths) + "---|",
    ]
    from kvquant_experiments.frontier import bits_per_value
    head_dim = meta["model"]["head_dim"]
    f32 = {(r["n_tokens_asked"], r["depth"]) for r in result["rows"]
           if r["codec"] == "f32" and r["retrieved"]}
    for spec in dict.fromkeys(r["codec"] for r in result["rows"]):
        cells = []
        for n in lengths:
            if (spec, n) not in s:
                cells.append("–")
                continue
            hit, asked, missed = s[(spec, n)]
            ran = {r["depth"] for r in result["rows"]
                   if r["codec"] == spec and r["n_tokens_asked"] == n}
            not_run = [d for d in sorted(meta["depths"]) if d not in ran]
            cells.append(f"{hit}/{asked}"
                         + (f" [{', '.join(f'{round(100 * d)}%' for d in missed)}]"
                            if missed else "")
                         + (f" (not run: {', '.join(f'{round(100 * d)}%' for d in not_run)})"
                            if not_run else ""))
        mine = {(r["n_tokens_asked"], r["depth"]) for r in result["rows"]
                if r["codec"] == spec and r["retrieved"]}
        ran = {(r["n_tokens_asked"], r["depth"]) for r in result["rows"] if r["codec"] == spec}
        same = "yes" if (f32 & ran) <= mine else "no"
        label = f"`{spec}`" + (f" (pick <= {', '.join(picks[spec])})" if spec in picks else "")
        bits = bits_per_value(spec, head_dim, tokens=max(lengths))
        lines.append(f"| {label} | {bits:.2f} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


def write_passkey(result, out_dir):
    """``<stem>.json`` (everything), ``<stem>.csv`` (a row per prompt), ``<stem>.md``."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(result["meta"]))
    write_json(stem + ".json", result)
    write_csv(stem + ".csv", result["rows"], CSV_COLUMNS)
    text = format_markdown(result) + "\n"
    atomic_write(stem + ".md", lambda f: f.write(text))
    return [stem + ".json", stem + ".csv", stem + ".md"]


def _floats(text, what):
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated numbers, got {text!r}") from None


# --------------------------------------------------------------------------------------------
# Command line (kvquant_experiments.study)
# --------------------------------------------------------------------------------------------
RESUMES = True          # the result JSON is written after every prompt and read back
ERRORS = (ImportError,)  # a model format whose extra is not installed


def add_arguments(p):
    p.add_argument("--model", default="smollm2",
                   help="smollm2, gemma3-270m, or a GGUF file path")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                   help="prompt lengths in tokens (comma-separated; at most the trained context)")
    p.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)),
                   help="where the number goes, as shares of the filler (0 = first, 1 = last)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="fixes the numbers hidden")
    p.add_argument("--choices", metavar="JSON", default=None,
                   help="a frontier choices file (data/results/frontier-choices.json): its "
                        "picks are measured after " + ", ".join(DEFAULT_BASELINES))
    p.add_argument("--configs", default=None,
                   help="comma-separated pair specs instead of the baselines (the picks of "
                        "--choices are added)")
    p.add_argument("--out", default=None,
                   help="output folder (default: ./passkey-<model>-L..-d..-s..)")
    p.add_argument("--list", action="store_true", help="print the configurations, run nothing")
    add_quiet_argument(p)


def outputs(args):
    # a bad number fails before --out is made; without --out the run's own folder goes in the
    # current one
    _floats(args.lengths, "lengths")
    _floats(args.depths, "depths")
    return [] if args.list else [Output(args.out if args.out is not None else ".")]


def run(args, progress):
    from kvquant.specs import split_spec_text
    lengths = [int(n) for n in _floats(args.lengths, "lengths")]
    depths = _floats(args.depths, "depths")
    configs = split_spec_text(args.configs) if args.configs else list(DEFAULT_BASELINES)
    choices = None
    if args.choices:
        from kvquant_experiments.frontier_picks import load_choices
        choices = load_choices(args.choices)
        configs += [c["pair"] for c in choices.values() if c["pair"] not in configs]
    if args.list:
        print("\n".join(configs))
        return 0

    meta = {"model_name": args.model, "lengths": lengths, "depths": depths, "seed": args.seed}
    out = args.out or result_stem(meta)
    path = os.path.join(out, result_stem(meta) + ".json")
    done = None
    if os.path.isfile(path):
        with open(path) as f:
            done = json.load(f)["rows"]
        progress(f"resuming from {path}: {len(done)} prompts measured")
    result = run_passkey(args.model, configs, lengths, depths, args.seed, done=done,
                         on_prompt=lambda r: write_passkey(r, out), progress=progress,
                         choices=choices)
    paths = write_passkey(result, out)
    print(format_markdown(result))
    for path in paths:
        print(f"wrote {path}")
    return 0


main = study_main(__name__)


if __name__ == "__main__":
    sys.exit(main())
