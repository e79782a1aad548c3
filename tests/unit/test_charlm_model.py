"""The char LSTM's shapes and loss, and batched name sampling."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from ddpflow.registry.serving import LogitsOnly
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.model import CharLSTM
from ddpflow.workloads.charlm.sampling import MAX_NAME_LEN, generate_names
from ddpflow.workloads.charlm.vocab import CHARACTERS, CONTEXT_LEN, VOCAB_SIZE

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


NAME_CHARS = set(CHARACTERS) - {"*", "+"}
SMALL = CharLSTMConfig(hidden_size=16, num_layers=2)


def make_model(config: CharLSTMConfig = SMALL, seed: int = 0) -> CharLSTM:
    torch.manual_seed(seed)
    return CharLSTM(config)


def biased_model(index: int) -> CharLSTM:
    """A model whose output ignores its input and strongly favours one symbol."""
    model = make_model(CharLSTMConfig(hidden_size=4, num_layers=1))
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.fill_(-50.0)
        model.fc.bias[index] = 50.0
    return model


def batch(batch_size: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB_SIZE, (batch_size, CONTEXT_LEN), generator=g)
    y = torch.randint(0, VOCAB_SIZE, (batch_size, CONTEXT_LEN), generator=g)
    return x, y


# --- model ------------------------------------------------------------------------------------


def test_default_config_is_the_seed_model() -> None:
    config = CharLSTMConfig()
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (31, 128, 4)
    assert config.dropout == pytest.approx(0.1)


def test_forward_without_targets_returns_logits_and_none() -> None:
    x, _ = batch(3)
    logits, loss = make_model()(x)
    assert logits.shape == (3, 8, 31)
    assert loss is None


def test_forward_with_targets_returns_the_cross_entropy() -> None:
    model = make_model().eval()
    x, y = batch(4)
    logits, loss = model(x, y)
    assert loss is not None and loss.dim() == 0
    expected = F.cross_entropy(logits.transpose(1, 2), y)
    assert torch.allclose(loss, expected)
    # Sanity: an untrained model is close to uniform over 31 symbols.
    assert abs(loss.item() - torch.log(torch.tensor(31.0)).item()) < 0.5


def test_forward_accepts_int32_indices() -> None:
    model = make_model().eval()
    x, y = batch(2)
    a, loss_a = model(x, y)
    b, loss_b = model(x.int(), y.int())
    assert torch.equal(a, b) and torch.equal(loss_a, loss_b)


@pytest.mark.parametrize(("hidden", "layers"), [(8, 1), (12, 3), (32, 2)])
def test_sizes_are_configurable(hidden: int, layers: int) -> None:
    model = make_model(CharLSTMConfig(hidden_size=hidden, num_layers=layers))
    assert model.lstm.hidden_size == hidden
    assert model.lstm.num_layers == layers
    assert model.fc.in_features == hidden and model.fc.out_features == 31
    logits, _ = model(batch(2)[0])
    assert logits.shape == (2, 8, 31)


def test_dropout_applies_between_layers() -> None:
    assert (
        make_model(CharLSTMConfig(hidden_size=8, num_layers=3, dropout=0.25)).lstm.dropout == 0.25
    )


def test_single_layer_with_dropout_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = CharLSTM(CharLSTMConfig(hidden_size=8, num_layers=1, dropout=0.1))
    assert model.lstm.dropout == 0.0


def test_training_reduces_the_loss() -> None:
    model = make_model(CharLSTMConfig(hidden_size=16, num_layers=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = batch(4)
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7


def test_config_dict_round_trip() -> None:
    config = CharLSTMConfig(hidden_size=64, num_layers=3, dropout=0.2)
    data = config.to_dict()
    assert data == {"vocab_size": 31, "hidden_size": 64, "num_layers": 3, "dropout": 0.2}
    assert CharLSTMConfig.from_dict(data) == config


def test_config_from_dict_ignores_unknown_and_defaults_missing() -> None:
    config = CharLSTMConfig.from_dict({"hidden_size": 7, "unknown": 1})
    assert config == CharLSTMConfig(hidden_size=7)


def test_logits_only_wrapper() -> None:
    model = make_model().eval()
    x, _ = batch(2)
    assert torch.equal(LogitsOnly(model)(x), model(x)[0])


# --- sampling ---------------------------------------------------------------------------------


def test_generate_names_shape_and_alphabet() -> None:
    names = generate_names(make_model(), 40, seed=3)
    assert len(names) == 40
    assert all(isinstance(n, str) for n in names)
    for name in names:
        assert len(name) <= MAX_NAME_LEN == 30
        assert "*" not in name and "+" not in name
        assert set(name) <= NAME_CHARS
    # An untrained model rarely stops at once: most names are non-empty and they vary.
    assert sum(bool(n) for n in names) > 20
    assert len(set(names)) > 20


def test_generate_names_is_deterministic_per_seed() -> None:
    model = make_model()
    assert generate_names(model, 10, seed=5) == generate_names(model, 10, seed=5)
    assert generate_names(model, 10, seed=5) != generate_names(model, 10, seed=6)


def test_generate_zero_names() -> None:
    assert generate_names(make_model(), 0) == []


def test_stop_symbol_gives_empty_names() -> None:
    assert generate_names(biased_model(CHARACTERS.index("+")), 4, seed=0) == [""] * 4


def test_names_are_capped_at_thirty_characters() -> None:
    assert generate_names(biased_model(CHARACTERS.index("a")), 3, seed=0) == ["a" * 30] * 3


def test_pad_symbol_is_never_sampled() -> None:
    # Even when the pad symbol dominates, it is masked out; the next best is drawn instead.
    model = biased_model(CHARACTERS.index("*"))
    with torch.no_grad():
        model.fc.bias[CHARACTERS.index("z")] = 40.0
    assert generate_names(model, 2, seed=0) == ["z" * 30] * 2


@pytest.mark.parametrize("training", [True, False])
def test_mode_is_restored(training: bool) -> None:
    model = make_model()
    model.train(training)
    generate_names(model, 3, seed=0)
    assert model.training is training
    assert all(m.training is training for m in model.modules())


def test_mode_is_restored_after_an_error() -> None:
    class Broken(CharLSTM):
        def forward(self, x, targets=None):
            raise RuntimeError("boom")

    model = Broken(CharLSTMConfig(hidden_size=4, num_layers=1)).train()
    with pytest.raises(RuntimeError, match="boom"):
        generate_names(model, 2)
    assert model.training


def test_sampling_does_not_track_gradients() -> None:
    model = make_model()
    generate_names(model, 2, seed=0)
    assert all(p.grad is None for p in model.parameters())
