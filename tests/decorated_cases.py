"""Functions a user's script decorates, for the tests of nnsight sending a function by value.

``DEFINITIONS`` is script text: a test puts it into a file that runs as ``__main__``, so nnsight's
serializer sends every function in it by value, from its source. ``CASES`` there maps a case name to
``(function, arguments)``; a test picks the cases it is about. Shared by ``test_serializer_fix.py`` (the
wire: dumped by one build, loaded by another) and ``test_upstream_repros.py`` (a round trip in one
process).
"""

DEFINITIONS = '''
import functools
import torch

SCALE = 3

def tag(label):
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return f"{label}({fn(*args, **kwargs)})"
        return wrapper
    return decorator

@tag("A")
@tag("B")
def stacked(x):
    return x

wrapped_lambda = tag("L")(lambda x: x * 2)

@torch.no_grad()
def scaled(x):
    return x * SCALE

def register(fn):
    return fn

def make_closure(k):
    @register
    def add_k(x):
        return x + k
    return add_k

def plain(x):
    return x + SCALE

CASES = {"stacked": (stacked, (1,)), "wrapped_lambda": (wrapped_lambda, (1,)),
         "no_grad": (scaled, (torch.tensor(2.0),)), "decorated_closure": (make_closure(5), (1,)),
         "plain": (plain, (1,))}
'''
