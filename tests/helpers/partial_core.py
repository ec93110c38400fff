"""A stand-in for the core's ``make_graphed_callables`` in the partial-graph CPU tests,
to see what the manager's default capture backend hands the core."""


class FakeCore:
    """Stands in for cudagraphs.core.make_graphed_callables: records its arguments and
    returns counting wrappers (a single one for a single callable when ``bare``)."""

    def __init__(self, bare=False):
        self.calls, self.replays, self.bare, self.sharing = [], 0, bare, []
        self.owned, self.unreached, self.owned_outputs = [], [], []
        self.release_cache = []

    def __call__(
        self,
        modules,
        sample_args,
        sample_kwargs=None,
        clone_param_grads_on_return=True,
        _buffer_sharing=None,
        _unreached_outputs=None,
        _owned_outputs=(),
        _release_cache=True,
    ):
        self.calls.append((modules, sample_args, sample_kwargs))
        self.release_cache.append(_release_cache)
        self.sharing.append(_buffer_sharing)
        self.unreached.append(_unreached_outputs)
        self.owned_outputs.append(frozenset(_owned_outputs))
        self.owned.append(clone_param_grads_on_return)

        def graphed(fn):
            def run(*args, **kwargs):
                self.replays += 1
                return fn(*args, **kwargs)

            return run

        out = tuple(graphed(fn) for fn in modules)
        return out[0] if self.bare and len(out) == 1 else out
