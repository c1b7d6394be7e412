"""Documents -> scored requests, as lm-evaluation-harness 0.4.x builds them.

An :class:`Item` is one document: one (context, continuation) pair per choice, the gold index
and the choice texts (``acc_norm`` divides by their lengths in characters). The prompt is
lm-eval's plain-text one (no chat template): the description, then each few-shot example as
``text + target_delimiter + answer + fewshot_delimiter``, then the document's text; each choice
is scored as the continuation ``target_delimiter + choice``. WinoGrande (``multiple_input``)
turns it round: one context per choice and one shared continuation.

Token ids (:func:`encode_pair`) follow lm-eval's ``_encode_pair``: trailing spaces of the context
move to the continuation; the context and the whole string are encoded with the model's own
special tokens (a BOS where the model's tokenizer adds one, as lm-eval 0.4.13's HFLM leaves it to
the tokenizer), and the continuation is the whole encoding's tail after the context's token count.
"""
from dataclasses import dataclass

from kvquant.tasks.data import read_saved_split
from kvquant.tasks.definitions import MMLU_SUBJECTS, get_task

__all__ = ["Item", "TASK_GROUPS", "build_items", "encode_pair", "item_requests", "load_docs",
           "task_members"]

# Names that stand for several registered tasks (lm-eval's groups): their items are the members'
# items in this order, --limit applying to each member (as lm-eval's limit does per subtask).
TASK_GROUPS = {"mmlu": tuple(f"mmlu_{s}" for s in MMLU_SUBJECTS)}


@dataclass(frozen=True)
class Item:
    """One scored document.

    Attributes
    ----------
    task : str
        The registered task it comes from (an MMLU subject for the group "mmlu").
    doc_id : int
        Index of the document in its split.
    contexts, continuations : tuple of str
        One (context, continuation) pair per choice.
    gold : int
    choice_texts : tuple of str
        The choices as ``doc_to_choice`` gives them (``acc_norm``'s lengths).
    """

    task: str
    doc_id: int
    contexts: tuple
    continuations: tuple
    gold: int
    choice_texts: tuple

    @property
    def key(self):
        """What identifies the item across runs: (task, doc_id)."""
        return (self.task, self.doc_id)


def task_members(name):
    """The registered task names a name stands for (a group's members, or itself)."""
    if name in TASK_GROUPS:
        return TASK_GROUPS[name]
    return (get_task(name).name,)


def load_docs(task, split=None):
    """The processed documents of a task's split (default: the scored split)."""
    task = get_task(task)
    if task.docs is not None:
        docs = list(task.docs)
    else:
        docs = read_saved_split(task.dataset, split or task.split)
    if task.process_docs is not None:
        docs = [task.process_docs(d) for d in docs]
    return docs


def _fewshot_prefix(task, num_fewshot):
    """Description and few-shot examples: the text every item's context starts with."""
    if num_fewshot < 0:
        raise ValueError(f"num_fewshot must be >= 0, got {num_fewshot}")
    shots = ""
    if num_fewshot:
        if task.fewshot_split is None:
            raise ValueError(f"{task.name}: no few-shot split in the offline data (the wheel "
                             "holds validation splits only); run it 0-shot")
        pool = load_docs(task, task.fewshot_split)
        if num_fewshot > len(pool):
            raise ValueError(f"{task.name}: {num_fewshot} few-shot examples asked, the "
                             f"{task.fewshot_split} split has {len(pool)}")
        for doc in pool[:num_fewshot]:      # lm-eval's first_n sampler
            answer = task.doc_to_choice(doc)[task.doc_to_target(doc)]
            shots += (task.doc_to_text(doc) + task.target_delimiter + answer
                      + task.fewshot_delimiter)
    return shots


def item_requests(task, doc, doc_id, prefix=""):
    """The :class:`Item` of one processed document, after the prompt prefix ``prefix``."""
    choices = task.doc_to_choice(doc)
    description = task.description(doc) if callable(task.description) else task.description
    head = description + prefix
    if task.multiple_input:
        target = task.doc_to_target(doc)
        contexts = tuple(head + c for c in choices)
        continuations = (task.target_delimiter + target,) * len(choices)
        gold = task.doc_to_text(doc)
    else:
        context = head + task.doc_to_text(doc)
        contexts = (context,) * len(choices)
        continuations = tuple(task.target_delimiter + c for c in choices)
        gold = task.doc_to_target(doc)
    if not 0 <= gold < len(choices):
        raise ValueError(f"{task.name} document {doc_id}: gold index {gold} outside its "
                         f"{len(choices)} choices")
    return Item(task.name, int(doc_id), contexts, continuations, int(gold), tuple(choices))


def build_items(name, limit=None, num_fewshot=0, start=0):
    """The items of a task (or group), in split order.

    Parameters
    ----------
    name : str
        A registered task, a group (``"mmlu"``), or a JSONL file path.
    limit : int, optional
        The first ``limit`` documents (of each member for a group), after ``start``.
    num_fewshot : int
    start : int
        Skip the first ``start`` documents (of each member).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    items = []
    for member in task_members(name) if not str(name).endswith(".jsonl") else (name,):
        task = get_task(member)
        prefix = _fewshot_prefix(task, num_fewshot)
        docs = load_docs(task)
        stop = len(docs) if limit is None else min(len(docs), start + limit)
        items.extend(item_requests(task, docs[i], i, prefix) for i in range(start, stop))
    return items


def encode_pair(encode, context, continuation):
    """(context ids, continuation ids) as lm-eval's ``_encode_pair`` forms them.

    Parameters
    ----------
    encode : callable(str) -> sequence of int
        The model's encoder, with the special tokens it adds by default (a BOS or none).
    context, continuation : str
        A non-empty context (lm-eval stands a BOS or EOS in for an empty one; no task here has
        one, and a JSONL item's context must not be empty).
    """
    if not context:
        raise ValueError("a request needs a non-empty context")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = [int(t) for t in encode(context + continuation)]
    context_ids = [int(t) for t in encode(context)]
    return context_ids, whole[len(context_ids):]
