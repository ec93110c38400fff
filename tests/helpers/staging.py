"""A fake CUDA binding for in-graph staging tests on the CPU: the memcpy nodes of a
fake graph, node updates recorded, sources listed in ``refuse`` refused."""

from types import SimpleNamespace

FAKE_GRAPH = SimpleNamespace(raw_cuda_graph=lambda: 11, raw_cuda_graph_exec=lambda: 22)
REFUSAL = "cudaErrorInvalidValue (1)"


class FakeRuntime:
    """Records node updates as (node handle, source); refuses sources in ``refuse``."""

    def __init__(self, nodes):
        self.nodes = nodes
        self.calls = []
        self.refuse = set()

    def memcpy_nodes(self, graph):
        assert graph == 11
        return self.nodes

    def memcpy_source_setter(self, graph_exec, node):
        assert graph_exec == 22

        def set_source(src):
            if src in self.refuse:
                return REFUSAL
            self.calls.append((node.handle, src))
            return None

        return set_source
