"""`vlforge view`: a local page of runs (curves, GRPO rollouts, eval answers), or one HTML file of it.

    vlforge view runs/demo-sft runs/demo-grpo          # http://127.0.0.1:8600, loopback only by default
    vlforge view runs/ --export report.html            # one self-contained file, images inlined

The page is static/index.html with static/view.js (ours) and plotly.js, served from the installed
plotly package (`pip install 'vlforge[view]'`), never fetched from the internet. The page reads
/api/runs and /api/run/I and polls them, so a running run's curves and samples grow as it logs.
The export writes the same page with every run's data, the images and plotly.js inlined.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from vlforge.config import ConfigError
from vlforge.train.metrics import check_writable
from vlforge.train.samples import FOLDER
from vlforge.view.runs import find_runs, run_data, run_summary

STATIC = Path(__file__).parent / "static"
IMAGE_NAME = re.compile(r"^[0-9a-f]{24}\.png$")  # SampleLog's thumbnail names: nothing else is served


def plotly_js() -> str:
    """plotly.js from the installed plotly package (its offline bundle)."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise ConfigError("vlforge view draws its charts with plotly: pip install 'vlforge[view]'") from None
    return get_plotlyjs()


def build_app(paths: list[str | Path]):
    """The viewer's FastAPI app over the runs of `paths` (found again on each /api/runs: new runs appear)."""
    try:
        from fastapi import FastAPI, HTTPException
        from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
    except ImportError:
        raise ConfigError("vlforge view needs fastapi and uvicorn: pip install 'vlforge[view]'") from None
    runs = find_runs(paths)  # a bad path fails now, before the server starts
    script = plotly_js()
    app = FastAPI(title="vlforge view", docs_url=None, redoc_url=None, openapi_url=None)

    def run_at(i: int) -> Path:
        if not 0 <= i < len(runs):
            raise HTTPException(404, f"no run {i}")
        return runs[i]

    @app.get("/", response_class=HTMLResponse)
    def index():
        return (STATIC / "index.html").read_text()

    @app.get("/static/{name}")
    def static(name: str):
        if name not in ("view.js", "view.css"):
            raise HTTPException(404, name)
        return FileResponse(STATIC / name)

    @app.get("/plotly.min.js")
    def plotly():
        return Response(script, media_type="text/javascript")

    @app.get("/api/runs")
    def all_runs():
        for run in find_runs(paths):  # runs started since (a folder of runs) join the end of the list
            if run not in runs:
                runs.append(run)
        return JSONResponse([run_summary(r) for r in runs])

    @app.get("/api/run/{i}")
    def one_run(i: int):
        return JSONResponse(run_data(run_at(i)))

    @app.get("/img/{i}/img/{name}")
    def image(i: int, name: str):
        path = run_at(i) / FOLDER / "img" / name
        if not IMAGE_NAME.match(name) or not path.is_file():
            raise HTTPException(404, name)
        return FileResponse(path, media_type="image/png")

    return app


def export_html(paths: list[str | Path], out: str | Path) -> Path:
    """The page as one file: the runs' data, their images as data: URIs, the script and styles inline."""
    runs = find_runs(paths)
    data = []
    for run in runs:
        d = run_data(run)
        images: dict[str, str] = {}
        for name in {p for kind in ("grpo", "eval") for row in d[kind] for p in _image_names(row)}:
            file = run / FOLDER / name
            if file.is_file():
                images[name] = "data:image/png;base64," + base64.b64encode(file.read_bytes()).decode()
        data.append({**d, "images": images})
    blob = json.dumps({"runs": data}).replace("</", "<\\/")  # no "</script>" inside the script element
    page = (STATIC / "index.html").read_text()
    page = page.replace('<link rel="stylesheet" href="static/view.css">',
                        f"<style>{(STATIC / 'view.css').read_text()}</style>")
    page = page.replace('<script src="plotly.min.js"></script>', f"<script>{plotly_js()}</script>")
    page = page.replace('<script src="static/view.js"></script>',
                        f"<script>window.VLFORGE_EXPORT = {blob};</script>\n"
                        f"<script>{(STATIC / 'view.js').read_text()}</script>")
    out = Path(out)
    out.write_text(page)
    return out


def _image_names(row: dict) -> list[str]:
    names = list(row.get("images", []))
    for response in row.get("responses", []):
        for turn in response.get("turns", []):
            names += turn.get("images", [])
    return names


def command(paths: list[str], host: str, port: int, export: str | None) -> int:
    """`vlforge view`: serve the page, or write it to `export`."""
    if export:
        check_writable(export, "--export")  # before the runs are read
        print(f"wrote {export_html(paths, export)}")
        return 0
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: must be 0..65535")
    serve_view(paths, host, port)
    return 0


def serve_view(paths: list[str | Path], host: str = "127.0.0.1", port: int = 8600) -> None:
    import uvicorn

    app = build_app(paths)
    print(f"vlforge view: http://{host}:{port} (Ctrl-C to stop)")
    uvicorn.run(app, host=host, port=port, log_level="warning")
