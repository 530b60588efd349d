"""act_pyg.convert: same outputs, exact gradients at L0 (gradchecks included), the other
message-passing layers, fallbacks, the conversion report, errors and GAT's coefficient bits."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import KINDS, stock_and_converted
from torch import nn
from torch_geometric.nn import GATConv, GCNConv, GINConv, GraphConv, SAGEConv
from torch_geometric.nn.dense.linear import Linear as PyGLinear

import act_pyg
from act_pyg import bench
from act_pyg.functions import GATAttention, LinearAggregation, LinearFunction
from actcore import memory

CONV_CLASS = {
    "gcn": act_pyg.QGCNConv,
    "sage": act_pyg.QSAGEConv,
    "gat": act_pyg.QGATConv,
    "gin": act_pyg.QGINConv,
}


def _run(model, x, edge_index, seed=5):
    torch.manual_seed(seed)
    return model(x, edge_index)


# ---- forward -------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["L0", "L3"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_equal_after_convert(kind, level, small):
    """Training-mode forward (dropout included) and eval forward are bit-identical."""
    stock, conv = stock_and_converted(
        lambda: bench.GNN(kind, 16, 32, 5, heads=4, dropout=0.3), level
    )
    assert type(conv.conv1) is CONV_CLASS[kind] and type(conv.conv2) is CONV_CLASS[kind]
    if kind == "gat":
        assert conv.conv1.heads == 4
    x = small.x.clone().requires_grad_()
    assert torch.equal(_run(stock, x, small.edge_index), _run(conv, x, small.edge_index))
    stock.eval()
    conv.eval()
    assert torch.equal(_run(stock, x, small.edge_index), _run(conv, x, small.edge_index))
    with torch.no_grad():
        assert torch.equal(stock(small.x, small.edge_index), conv(small.x, small.edge_index))


def _convs(model):
    return [m for m in model.modules() if isinstance(m, tuple(CONV_CLASS.values()))]


@pytest.mark.parametrize("style", bench.STYLES)
@pytest.mark.parametrize("kind", bench.MODELS)
def test_forward_bitwise_equal_example_and_module_style(kind, style, small):
    """At L3 (the model scope active: functional F.relu / F.elu / F.dropout routed), the
    training forward with the same RNG draws the same numbers and gives the same output,
    with and without gradients for the features; eval too."""
    torch.manual_seed(1)
    stock = bench.make_model(kind, 16, 32, 5, style=style, dropout=0.3)
    conv = act_pyg.convert(copy.deepcopy(stock), "L3")
    assert {type(c) for c in _convs(conv)} == {CONV_CLASS[kind]} and len(_convs(conv)) == 2
    for x in (small.x, small.x.clone().requires_grad_()):
        out_s = _run(stock, x, small.edge_index)
        rng_s = torch.get_rng_state()
        out_c = _run(conv, x, small.edge_index)
        assert torch.equal(out_s, out_c)
        assert torch.equal(torch.get_rng_state(), rng_s)  # the same draws, no extra ones
    stock.eval()
    conv.eval()
    assert torch.equal(_run(stock, x, small.edge_index), _run(conv, x, small.edge_index))


def test_convert_keeps_parameters_and_state_dict():
    model = bench.GNN("gat", 16, 32, 5)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    act_pyg.convert(model)
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert isinstance(model.conv1, GATConv)  # a subclass: isinstance still holds


# ---- gradients -----------------------------------------------------------------------------

VARIANTS = {
    "gcn": lambda: bench.GNN("gcn", 16, 32, 5, dropout=0.3),
    "sage": lambda: bench.GNN("sage", 16, 32, 5, dropout=0.3),
    "gat": lambda: bench.GNN("gat", 16, 32, 5, heads=4, dropout=0.3),
    "gcn-cached-improved": lambda: GCNConv(16, 8, cached=True, improved=True),
    "gcn-no-normalize": lambda: GCNConv(16, 8, normalize=False),
    "gcn-target-to-source": lambda: GCNConv(16, 8, flow="target_to_source"),
    "gcn-mean": lambda: GCNConv(16, 8, aggr="mean"),
    "sage-sum-no-root": lambda: SAGEConv(16, 8, aggr="sum", root_weight=False),
    "gat-mean-residual": lambda: GATConv(16, 8, heads=3, concat=False, residual=True, dropout=0.2),
    "gat-no-loops-t2s": lambda: GATConv(
        16, 8, heads=2, add_self_loops=False, flow="target_to_source"
    ),
    "gin": lambda: bench.GNN("gin", 16, 32, 5, dropout=0.3),
    "gin-mean-eps-t2s": lambda: GINConv(
        nn.Sequential(nn.Linear(16, 8), nn.Tanh()),
        train_eps=True,
        eps=0.3,
        aggr="mean",
        flow="target_to_source",
    ),
    **{
        f"example-{kind}": (lambda kind=kind: bench.make_model(kind, 16, 32, 5, style="example"))
        for kind in bench.MODELS
    },
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gradients_at_L0_equal_stock(name, small):
    """At L0 (nothing quantized) every gradient matches the stock conv's in float64."""
    stock, conv = stock_and_converted(VARIANTS[name], "L0", torch.float64)
    assert _convs(conv)
    x1 = small.x.double().requires_grad_()
    x2 = small.x.double().requires_grad_()
    out1, out2 = _run(stock, x1, small.edge_index), _run(conv, x2, small.edge_index)
    assert torch.equal(out1, out2)
    grad = torch.randn_like(out1)
    out1.backward(grad)
    out2.backward(grad)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    for (n, p1), (_, p2) in zip(stock.named_parameters(), conv.named_parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-12, atol=1e-12, msg=n)


def _graph_for(conv, x, edge_index):
    if isinstance(conv, GATConv):
        from act_pyg.convs import _gat_graph

        return _gat_graph(conv, edge_index, x.shape[0])
    return conv._graph(x, edge_index, None)


def test_gradcheck_linear_aggregation(small):
    x = small.x[:40, :3].double().requires_grad_()
    ei = small.edge_index[:, (small.edge_index < 40).all(0)]
    for make in (lambda: GCNConv(3, 4), lambda: GCNConv(3, 4, aggr="mean")):
        conv = act_pyg.convert(make().double(), "L0")
        graph = _graph_for(conv, x, ei)
        assert graph.narrow.dtype == torch.int32 and graph.weight is not None

        def f(h, conv=conv, graph=graph):
            return LinearAggregation.apply(
                h,
                conv,
                graph,
                conv.aggr == "mean",
                conv.flow,
                lambda t: conv.propagate(graph.edge_index, x=t, edge_weight=graph.weight),
            )

        assert torch.autograd.gradcheck(f, (x,), fast_mode=True)


def test_gradcheck_gat_attention(small):
    torch.manual_seed(0)
    n = 40
    ei = small.edge_index[:, (small.edge_index < n).all(0)]
    conv = act_pyg.convert(GATConv(16, 3, heads=2).double(), "L0")
    h = torch.randn(n, 2, 3, dtype=torch.float64, requires_grad=True)
    att_src = torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True)
    att_dst = torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True)
    graph = _graph_for(conv, h, ei)

    def f(h, a, b):
        return GATAttention.apply(
            h,
            a,
            b,
            conv,
            graph,
            lambda t, alpha: conv.propagate(graph.edge_index, x=(t, t), alpha=alpha, size=None),
        )

    assert torch.autograd.gradcheck(f, (h, att_src, att_dst), fast_mode=True)


def test_gradcheck_linear_function():
    layer = act_pyg.convert(GCNConv(6, 4).double(), "L0")
    x = torch.randn(20, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    f = lambda x, w, b: LinearFunction.apply(x, w, b, layer, None)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w, b), fast_mode=True)


def test_random_projection_weight_gradient_is_unbiased():
    """EXACT's projection: E[grad W] is the exact one; the input gradient stays exact."""
    layer = act_pyg.convert(GCNConv(64, 8).double(), "L0")
    torch.manual_seed(0)
    x = torch.randn(50, 64, dtype=torch.float64)
    w = torch.randn(8, 64, dtype=torch.float64, requires_grad=True)
    g = torch.randn(50, 8, dtype=torch.float64)
    exact = g.t() @ x
    total = torch.zeros_like(exact)
    trials, single = 100, []
    for _ in range(trials):
        xi = x.clone().requires_grad_()
        out = LinearFunction.apply(xi, w, None, layer, 0.25)
        assert torch.equal(out, torch.nn.functional.linear(x, w))
        (gw, gx) = torch.autograd.grad(out, (w, xi), g)
        torch.testing.assert_close(gx, g @ w.detach())
        single.append(((gw - exact).norm() / exact.norm()).item())
        total += gw
    mean_err = ((total / trials - exact).norm() / exact.norm()).item()
    typical = sum(single) / trials
    assert typical > 0.3  # a single projected gradient is noisy...
    assert mean_err < 3 * typical / math.sqrt(trials)  # ...and the noise averages out: no bias


@pytest.mark.parametrize("kind", [*KINDS, "gin"])
def test_adaptive_bits_plan_every_conv_linear(kind, small):
    """At L3 each conv's linear transform is planned by the adaptive scheme: its backward
    hands the scheme its gradient, so steps are counted, statistics taken and a plan made
    for every linear (the convs' own linear kept its input at fixed bits, unplanned, and
    the scheme, never seeing a backward, took statistics on every step)."""
    torch.manual_seed(1)
    model = act_pyg.convert(bench.GNN(kind, 16, 32, 5, heads=4, dropout=0.3), "L3")
    scheme = model.act_adaptive
    scheme.interval, scheme.window = 2, 1
    y = torch.randint(0, 5, (small.num_nodes,))
    for _ in range(4):
        F.cross_entropy(model(small.x, small.edge_index), y).backward()
    assert scheme.steps == 4 and not scheme.collecting()  # replanned at 2 and 4: steady
    linears = [n for n, m in model.named_modules() if getattr(m, "act_scheme", None) is scheme]
    assert len(linears) >= 2
    for name in linears:
        stats = scheme.layers[name]
        assert stats.sens is not None and stats.plan, name  # observed, then planned
        assert stats.last_step == 3, name  # and packed its input on the last step


# ---- other message-passing layers, fallbacks, report, errors ------------------------------------------------


class Mixed(nn.Module):
    """GIN (converted), then layers without a converted version or configuration."""

    def __init__(self) -> None:
        super().__init__()
        mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        self.gin = GINConv(mlp)
        self.graph = GraphConv(64, 64)
        self.sage_norm = SAGEConv(64, 32, normalize=True)
        self.sage_max = SAGEConv(32, 4, aggr="max")

    def forward(self, x, edge_index):
        x = F.dropout(x, 0.2, training=self.training)
        x = F.elu(self.graph(self.gin(x, edge_index), edge_index))
        return self.sage_max(self.sage_norm(x, edge_index), edge_index)


def test_other_message_passing_layers_run_under_the_model_scope():
    """Layers without a converted class keep it; the model's scope compresses what they save
    (the MLP layers inside them become Q-layers), one mechanism for the whole forward."""
    data = bench.random_graph(2000, 20000, 16, seed=1)
    torch.manual_seed(0)
    stock = Mixed()
    conv = act_pyg.convert(copy.deepcopy(stock), "L3")
    report = conv.act_report
    assert set(report.hooks) == {"graph", "sage_norm", "sage_max"}
    assert "normalize=True" in report.hooks["sage_norm"]
    assert "aggr='max'" in report.hooks["sage_max"]
    assert "no converted version" in report.hooks["graph"]
    assert report.converted["gin"] == "QGINConv" and report.converted["gin.nn.0"] == "QLinear"
    assert type(conv.graph) is GraphConv and type(conv.graph.lin_rel) is act_pyg.QPyGLinear
    assert "ModelScope" in report.scope and "the rest of the forward" in str(report)
    x = data.x.clone().requires_grad_()
    with memory.track(stock) as fp:
        torch.manual_seed(0)
        ref = stock(x, data.edge_index)
    with memory.track(conv) as held:
        torch.manual_seed(0)
        out = conv(x, data.edge_index)
    assert torch.equal(out, ref)  # outputs never change
    del ref

    def part(report, prefix):
        return sum(b for k, b in report.by_module.items() if k.startswith(prefix))

    assert part(held, "gin") * 4 < part(fp, "gin")  # its int32 index: 3/4 of what it keeps
    assert part(held, "graph") * 2 < part(fp, "graph")  # with the input's int64 index
    assert part(held, "sage_norm") * 2 < part(fp, "sage_norm")
    # max aggregation: the E x C messages and the result stay exact, the linear inputs not
    assert part(held, "sage_max") < part(fp, "sage_max")
    out.square().sum().backward()
    for name, p in conv.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), name


def test_pyg_linear_is_a_q_layer():
    """PyG's own Linear (its MLP, its convs' transforms) keeps its input compressed, even
    when that input has no autograd history (features after dropout)."""
    torch.manual_seed(0)
    lin = PyGLinear(64, 32)
    stock = copy.deepcopy(lin)
    act_pyg.convert(lin, "L3")
    assert type(lin) is act_pyg.QPyGLinear and isinstance(lin, PyGLinear)
    x = F.dropout(torch.randn(500, 64), 0.5)  # graph-less, as node features usually are
    with memory.track(lin) as held:
        out = lin(x)
    assert torch.equal(out, stock(x))
    assert held.retained_bytes * 8 < x.nbytes
    lazy = act_pyg.convert(PyGLinear(-1, 8), "L3")
    assert lazy(x).shape == (500, 8) and lazy.in_channels == 64


@pytest.mark.parametrize("aggr", ["max", "min"])
def test_max_aggregation_under_the_hooks_routes_gradients_exactly(aggr):
    """x's gradient through a max/min aggregation: equal to stock (weights are exact; the
    compared messages are kept exact), where quantized messages would give NaN or zeros."""
    data = bench.random_graph(500, 4000, 16, seed=4)
    torch.manual_seed(0)
    stock = SAGEConv(16, 8, aggr=aggr, root_weight=False)
    conv = act_pyg.convert(copy.deepcopy(stock), "L3")
    grads = []
    for model in (stock, conv):
        x = data.x.clone().requires_grad_()
        model(x, data.edge_index).sum().backward()
        grads.append(x.grad)
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)


def test_message_passing_layers_at_L0_are_exact():
    data = bench.random_graph(200, 1000, 16, seed=2)
    torch.manual_seed(0)
    stock = Mixed()
    conv = act_pyg.convert(copy.deepcopy(stock), "L0")
    torch.manual_seed(1)
    stock(data.x, data.edge_index).sum().backward()
    torch.manual_seed(1)
    conv(data.x, data.edge_index).sum().backward()
    for p1, p2 in zip(stock.parameters(), conv.parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p1.grad)


def test_unsupported_inputs_fall_back_to_the_stock_forward(small):
    torch.manual_seed(0)
    sage = SAGEConv(16, 8)
    qsage = act_pyg.convert(copy.deepcopy(sage), "L3")
    x = small.x.requires_grad_()
    pair = (x, x[:100])
    ei = small.edge_index[:, small.edge_index[1] < 100]
    assert torch.equal(qsage(pair, ei), sage(pair, ei))  # bipartite input
    gat = GATConv(16, 8, heads=2)
    qgat = act_pyg.convert(copy.deepcopy(gat), "L3")
    out, (ei_a, alpha) = qgat(x, small.edge_index, return_attention_weights=True)
    ref, (ei_b, ref_alpha) = gat(x, small.edge_index, return_attention_weights=True)
    assert torch.equal(out, ref) and torch.equal(alpha, ref_alpha) and torch.equal(ei_a, ei_b)
    out.sum().backward()
    w = torch.rand(small.edge_index.shape[1], requires_grad=True)  # a learnable edge weight
    gcn = GCNConv(16, 8)
    qgcn = act_pyg.convert(copy.deepcopy(gcn), "L0")
    qgcn(x, small.edge_index, w).sum().backward()
    w_grad = w.grad.clone()
    w.grad = None
    gcn(x, small.edge_index, w).sum().backward()
    torch.testing.assert_close(w_grad, w.grad)


def test_report_names_what_was_converted_and_left():
    model = nn.Module()
    model.a = GCNConv(8, 8)
    model.b = SAGEConv(8, 8, normalize=True)
    model.c = GATConv(8, 8, edge_dim=3)
    model.d = GCNConv(8, 8)
    model.lin = nn.Linear(8, 8)
    model.bn = nn.BatchNorm1d(8)
    act_pyg.convert(model, "L2", exclude=("d",), random_projection=0.5)
    rep = model.act_report
    assert rep.level == "L2" and rep.random_projection == 0.5
    assert rep.converted["a"] == "QGCNConv"
    assert rep.converted["lin"] == "QLinear" and rep.converted["bn"] == "QBatchNorm1d"
    assert "normalize=True" in rep.hooks["b"] and "edge_dim" in rep.hooks["c"]
    assert rep.left["d"] == "excluded" and type(model.d) is GCNConv
    assert model.a.act_projection == 0.5
    text = str(rep)
    assert "QGCNConv" in text and "saved-tensor hooks b" in text and "left d: excluded" in text
    act_pyg.convert(model, "L1")  # again: new options
    assert model.a.act_level == "L1" and model.a.act_projection is None


def test_bad_level_and_options_raise_clear_errors():
    model = bench.GNN("gcn", 8, 8, 2)
    with pytest.raises(ValueError, match=r"'L9'.*L0, L1, L2, L3"):
        act_pyg.convert(model, "L9")
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="random_projection"):
            act_pyg.convert(model, random_projection=bad)
    with pytest.raises(ValueError, match="attention_bits"):
        act_pyg.convert(model, attention_bits=9)
    assert type(model.conv1) is GCNConv  # nothing converted by a failed call


def test_attention_coefficients_bits():
    """GAT's E x H coefficients: 8 bits by default when the level compresses, else exact."""
    from act_pyg.functions import attention_compressor
    from actcore.compressors import IDENTITY, Quantize

    alpha = torch.rand(5000, 4)
    conv = act_pyg.convert(GATConv(8, 8, heads=4), "L3")
    comp = attention_compressor(conv, alpha)
    assert isinstance(comp, Quantize) and comp.bits == 8 and not comp.per_sample
    act_pyg.convert(conv, "L3", attention_bits=2)
    assert attention_compressor(conv, alpha).bits == 2
    act_pyg.convert(conv, "L0")
    assert attention_compressor(conv, alpha) is IDENTITY


@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("gat")])
def test_gat_gradients_at_L0_are_bitwise_pyg(name, small):
    """L0 is plain PyTorch: a GAT's gradients are PyG's own, bit for bit (the fused
    attention backward, which reorders sums, is for the compressing levels)."""
    stock, conv = stock_and_converted(VARIANTS[name], "L0", torch.float32)
    x1 = small.x.detach().clone().requires_grad_()
    x2 = small.x.detach().clone().requires_grad_()
    out1, out2 = _run(stock, x1, small.edge_index), _run(conv, x2, small.edge_index)
    grad = torch.randn_like(out1)
    out1.backward(grad)
    out2.backward(grad)
    assert torch.equal(x1.grad, x2.grad)
    for (n, p1), (_, p2) in zip(stock.named_parameters(), conv.named_parameters(), strict=True):
        assert torch.equal(p1.grad, p2.grad), n


def test_fewbit_bits_reach_smooth_activation_modules(small):
    """``fewbit_bits`` opts a GNN's activation modules into FewBit's derivative codes, as
    ``actcore.convert`` does; the output stays PyG's own, bit for bit."""
    from actcore import fewbit

    class Net(nn.Module):
        def __init__(self, features: int) -> None:
            super().__init__()
            self.conv1, self.act, self.conv2 = GCNConv(features, 16), nn.ELU(), GCNConv(16, 4)

        def forward(self, x, edge_index):
            return self.conv2(self.act(self.conv1(x, edge_index)), edge_index)

    torch.manual_seed(0)
    stock = Net(small.x.shape[1])
    model = act_pyg.convert(copy.deepcopy(stock), "L3", fewbit_bits=2)
    assert isinstance(model.act, fewbit.ELU) and model.act.bits == 2
    assert torch.equal(model(small.x, small.edge_index), stock(small.x, small.edge_index))
    plain = act_pyg.convert(copy.deepcopy(stock), "L3")
    assert type(plain.act) is nn.ELU  # opt-in only
    with pytest.raises(ValueError, match="fewbit_bits"):
        act_pyg.convert(copy.deepcopy(stock), "L3", fewbit_bits=7)
