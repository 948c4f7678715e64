"""The runtime type checker the test suite's jaxtyping import hook applies to jaxrunner (``conftest.py``).

beartype, with PEP 484's numeric tower (an ``int`` passes for a ``float``, as for pyright), on every
annotated function and dataclass ``__init__``. One exception: JAX rebuilds a ``register_dataclass``
pytree by calling its ``__init__`` (from C++, so the caller is JAX's Python frame that unflattens),
with placeholder leaves (``ShapeDtypeStruct`` in ``eval_shape``, ``ArgInfo`` in ``lower``, shardings,
``object()``) where the fields say arrays; a constructor called by JAX itself is not checked
(jaxtyping issue 277). Constructions in jaxrunner's own code, traced or not, are. The user's own
parameter objects are not checked either: they validate their fields themselves and answer a wrong
type with a ValueError naming the field, which is what their tests check; nor are ``LLM``'s entry points
that take the user's prompts, which check each prompt's form and answer with an error naming the prompt.
"""

import functools
import os
import sys
from collections.abc import Callable

import beartype
import jax
import jaxtyping

_CONF = beartype.BeartypeConf(is_pep484_tower=True)
_JAXTYPING_DIR = os.path.dirname(jaxtyping.__file__) + os.sep
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_USER_PARAMETERS = {"SamplingParams.__init__", "StructuredOutputsParams.__init__", "LLM.generate", "LLM.stream"}


def _called_by_jax() -> bool:
    """Whether the ``__init__`` being checked was called from JAX's own code (past jaxtyping's wrappers)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_JAXTYPING_DIR):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_JAX_DIR)


def typechecker(fn: Callable) -> Callable:
    if fn.__qualname__ in _USER_PARAMETERS:
        return fn
    checked = beartype.beartype(conf=_CONF)(fn)
    if fn.__name__ != "__init__":
        return checked

    @functools.wraps(fn)
    def init(*args, **kwargs):
        return (fn if _called_by_jax() else checked)(*args, **kwargs)

    return init
