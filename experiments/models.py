"""A run's model: its name in file names (:func:`model_tag`) and its instance in a task
(:func:`model_of`: a model object runs in this process, a name is loaded once per worker
process)."""
import functools
import os

__all__ = ["model_of", "model_tag"]


def model_tag(model_name):
    """A model's name in file names: the name given, or a GGUF file's stem."""
    name = str(model_name)
    if name.lower().endswith(".gguf") or os.sep in name:
        name = os.path.splitext(os.path.basename(name))[0]
    return "".join(c if c.isalnum() or c in "._+-" else "_" for c in name)


@functools.lru_cache(maxsize=1)
def _loaded(name):
    from kvquant.models import load_model
    return load_model(name)


def model_of(source):
    """The model of a task: ``source`` is a model object (runs in this process) or a model
    name, loaded once per worker process. The caches come from the spec texts alone, so a
    plug-in kind's specs (``sim:``, ``probe:``) need nothing more than the model."""
    return _loaded(source) if isinstance(source, str) else source
