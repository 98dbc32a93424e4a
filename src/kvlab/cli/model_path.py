"""``kvlab model-path``: the local folder of a model's weights, for other tools to load."""

from __future__ import annotations

import typer

from kvlab.cli.common import ModelOpt


def register(app: typer.Typer) -> None:
    @app.command("model-path")
    def model_path_cmd(model: ModelOpt = "smollm2-135m") -> None:
        """Print the local folder of a model (nothing else on stdout), converting the bundled model first.

        The bundled model ships as a GGUF; kvlab converts it once to a safetensors folder under its cache
        directory (keyed by the GGUF's sha256), saying so on stderr. The folder loads anywhere, e.g.
        AutoModelForCausalLM.from_pretrained("$(kvlab model-path)"). A local folder or a cached Hugging
        Face id prints where it lies.
        """
        from kvlab.model.loading import resolve_model_dir

        path, _ = resolve_model_dir(model, progress=lambda msg: typer.echo(f"kvlab: {msg}", err=True))
        typer.echo(str(path.resolve()))
