"""minitransformer.settings: boolean environment variables read by one rule that refuses what it
does not know, and the configuration classes' SettingsError, which the programs tell in one
line while a ValueError from a bug keeps its traceback."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minitransformer import backend, cli, data, nn, settings

WORDS = st.sampled_from(settings.TRUE + settings.FALSE)


@given(word=WORDS, case=st.sampled_from([str.lower, str.upper, str.title]), pad=st.sampled_from(["", " ", "\t "]))
def test_a_boolean_variable_is_on_or_off_in_any_case_and_spacing(word, case, pad):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MT_DEBUG", pad + case(word) + pad)
        assert settings.env_flag("MT_DEBUG") is (word in settings.TRUE)


@given(value=st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"), min_size=1))
def test_any_other_value_is_refused_naming_the_variable(value):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MT_DEBUG", value)
        if not value.strip():
            assert settings.env_flag("MT_DEBUG", default=True) is True  # empty: the default
        elif value.strip().lower() in settings.TRUE + settings.FALSE:
            settings.env_flag("MT_DEBUG")
        else:
            with pytest.raises(settings.SettingsError, match="MT_DEBUG"):
                settings.env_flag("MT_DEBUG")


def test_a_value_that_read_as_on_is_off_now(monkeypatch):
    """MT_DEBUG=false or off used to turn debug on: anything but "" and "0" did."""
    for value in ("false", "off", "no", "0", ""):
        monkeypatch.setenv("MT_DEBUG", value)
        assert cli.debug_from_env() is False


def test_an_unknown_value_of_mt_emulate_cuda_is_refused_where_cuda_is_asked_for(monkeypatch):
    monkeypatch.setattr(backend, "_refused", settings.SettingsError("MT_EMULATE_CUDA='maybe' is neither on nor off"))
    with pytest.raises(settings.SettingsError, match="MT_EMULATE_CUDA"):
        backend.check_device("cuda")
    assert backend.check_device("cpu") == "cpu"


@pytest.mark.parametrize("make", [
    lambda: nn.TransformerConfig(vocab_size=100, d_model=30, h=4),
    lambda: nn.TransformerConfig(vocab_size=100, dropout=1.5),
    lambda: nn.TransformerConfig(vocab_size=0),
    lambda: nn.TransformerConfig.from_dict({"vocab_size": 100, "heads": 4}),
    lambda: nn.MultiHeadAttention(30, 4),
    lambda: data.TokenizerConfig(vocab_size=3),
    lambda: data.SubwordNmtConfig(merges=0),
    lambda: data.TokenBatcher([[5, 6]], [[7]], max_tokens=0),
    lambda: data.TokenBatcher([[5] * 20], [[7]], max_tokens=100, max_len=8),  # every pair too long
])
def test_a_configuration_class_refuses_a_setting_with_its_own_error(make):
    with pytest.raises(settings.SettingsError) as e:
        make()
    assert isinstance(e.value, ValueError)  # what callers that catch ValueError still catch


def test_a_settings_error_is_one_line_and_a_value_error_keeps_its_traceback(capsys):
    def bad_settings(argv):
        nn.TransformerConfig(vocab_size=100, d_model=30, h=4)

    def bug(argv):
        raise ValueError("a bug")

    with pytest.raises(SystemExit, match=r"^error: .*d_model=30.*h=4") as e:
        cli.run(bad_settings, [])
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(settings.SettingsError):
        cli.run(bad_settings, ["--debug"])
    with pytest.raises(ValueError, match="a bug"):
        cli.run(bug, [])
