"""Every choice made on a name in the paper files (heads, model, decode, insnet) refuses a name it
does not know in one line that names the known ones: never a silent fall-through to another
branch (a decoder without its branch sampling plainly, an unknown cell becoming a tanh RNN, an
unknown protocol read as the paper's)."""

import pytest
import torch

import insnet
from data import loader
from decode import filter_log_probs
from heads import Head
from model import Recurrent, build_backbone

# The smallest config every backbone builds from.
CFG = dict(vocab_size=64, d_model=8, n_layer=1, dropout=0.0, block_size=16, kernel_size=2)


def refusals():
    """(what, the call, the words its one-line error must hold: the known names as shipped,
    which a coursework answer may add to)."""
    lp = torch.log_softmax(torch.randn(2, 10), -1)
    return [
        ("an unknown decoder", lambda: filter_log_probs(lp, "typicl"), "sample, topk, nucleus"),
        # greedy and beam choose without a filtered distribution: no filter of theirs.
        ("greedy", lambda: filter_log_probs(lp, "greedy"), "'greedy' (sample, topk, nucleus"),
        ("an unknown head", lambda: Head("adaptive", 4, 10, 0), "softmax, st, nmst"),
        ("an unknown cell", lambda: Recurrent("gru", 10, 8, 1, 0.0), "rnn or lstm"),
        ("an unknown backbone", lambda: build_backbone(dict(CFG, model="tcn")), "tcn"),
        (
            "an unknown protocol",
            lambda: build_backbone(dict(CFG, model="lstm", protocol="author")),
            "paper or authors",
        ),
        ("an unknown insertion decoder", lambda: insnet.Decoding("beam"), "greedy, sample, topk"),
        ("an unknown insertion order", lambda: loader.insertion_order(6, 1, (), "r2l"), "l2r"),
    ]


@pytest.mark.parametrize("index", range(len(refusals())), ids=[r[0] for r in refusals()])
def test_an_unknown_name_is_refused_in_one_line(index):
    what, call, words = refusals()[index]
    # A bug of a caller, not a user's flag (those are refused before, as UserError): a
    # ValueError with the known names, one line.
    with pytest.raises(ValueError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and words in message, (what, message)


def test_the_known_names_still_work():
    """The refusals take nothing away: plain sampling filters nothing, a checkpoint written
    before --protocol (none in its config) is the paper's, each story decoder is accepted."""
    lp = torch.log_softmax(torch.randn(2, 10), -1)
    torch.testing.assert_close(filter_log_probs(lp, "sample"), lp)
    # Shifted and divided by the temperature, renormalised: tempered sampling.
    tempered = filter_log_probs(lp, "sample", temperature=0.5)
    torch.testing.assert_close(tempered, torch.log_softmax(lp / 0.5, -1))
    # None: a checkpoint's config from before --protocol.
    for protocol in (None, "paper", "authors"):
        assert isinstance(build_backbone(dict(CFG, model="lstm", protocol=protocol)), Recurrent)
    for decoder in ("greedy", "sample", "topk"):
        assert insnet.Decoding(decoder).decoder == decoder
