"""The registry file: what it accepts, and the one-line errors for what it refuses."""

from __future__ import annotations

import pytest

from llm_server.models.registry import ModelEntry, RegistryError, load_registry


def _write(tmp_path, text: str):
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_every_field_parses(tmp_path):
    path = _write(
        tmp_path,
        """
[[models]]
id = "coder"
source = "./coder-folder"
aliases = ["code", "gpt-4o"]
pinned = true
idle_ttl = 300
concurrent_requests = 2
context_length = 4096
keep_quantized = true
pooling = "mean"
tool_parser = "hermes"

[[models]]
id = "small"
source = "acme/tiny@v1"
""",
    )
    coder, small = load_registry(path)
    assert coder == ModelEntry(
        id="coder",
        source=str((tmp_path / "coder-folder").resolve()),
        aliases=("code", "gpt-4o"),
        pinned=True,
        idle_ttl=300,
        concurrent_requests=2,
        context_length=4096,
        keep_quantized=True,
        pooling="mean",
        tool_parser="hermes",
    )
    assert small == ModelEntry(id="small", source="acme/tiny@v1")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('id = "a"', "'source' is required"),
        ('id = "a"\nsource = "x"\ncolour = 1', "unknown field 'colour'"),
        ('id = "a"\nsource = "x"\npinned = "yes"', "'pinned' has the wrong type (str)"),
        ('id = "a"\nsource = "x"\nidle_ttl = -1', "'idle_ttl' must be 0 or more seconds"),
        ('id = "a"\nsource = "x"\npooling = "max"', "'pooling' must be one of last, mean, cls"),
        ('id = "a"\nsource = "x"\nconcurrent_requests = 0', "must be at least 1"),
    ],
)
def test_bad_entries_name_the_field(tmp_path, body, message):
    path = _write(tmp_path, f"[[models]]\n{body}\n")
    with pytest.raises(RegistryError, match="#1") as info:
        load_registry(path)
    assert message in str(info.value)


def test_a_name_used_twice_is_refused(tmp_path):
    path = _write(
        tmp_path,
        '[[models]]\nid = "a"\nsource = "x"\n[[models]]\nid = "b"\nsource = "x"\naliases = ["a"]\n',
    )
    with pytest.raises(RegistryError, match="the name 'a' is used by both 'a' and 'b'"):
        load_registry(path)


def test_no_models_and_bad_toml(tmp_path):
    with pytest.raises(RegistryError, match="has no \\[\\[models\\]\\] tables"):
        load_registry(_write(tmp_path, "title = 1\n"))
    with pytest.raises(RegistryError, match="is not valid TOML"):
        load_registry(_write(tmp_path, "[[models]\n"))
    with pytest.raises(RegistryError, match="cannot read the models file"):
        load_registry(tmp_path / "missing.toml")
