"""The API's own description: the OpenAPI document at /openapi.json, shown by /docs and /redoc.

Swagger UI and ReDoc come from this package (oss_api/static/docs, versions in its
README.md), so the pages work on a host without Internet access and load nothing
from another origin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(__file__).parent / "static" / "docs"
ASSETS_URL = "/static/docs"
OPENAPI_URL = "/openapi.json"

# The schema FastAPI gives every route with parameters, whatever the route really answers.
_FRAMEWORK_422 = "#/components/schemas/HTTPValidationError"


def install(app: FastAPI) -> None:
    """Serve /docs, /redoc and their assets; make /openapi.json say only what the routes declare.

    ``app`` is created with ``docs_url=None, redoc_url=None``: these pages replace FastAPI's.
    """
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-static")
    app.openapi = lambda: document(app)  # type: ignore[method-assign]  # FastAPI's documented hook

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=OPENAPI_URL,
            title=f"{app.title} API",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon-32x32.png",
            oauth2_redirect_url=None,
            # No badge fetched from the public validator service.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=OPENAPI_URL,
            title=f"{app.title} API",
            redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_URL}/favicon-32x32.png",
            with_google_fonts=False,
        )


def document(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document of ``app`` (FastAPI's, built once and kept), finished."""
    schema = without_framework_422(FastAPI.openapi(app))
    schema.setdefault("components", {}).setdefault("schemas", {})[PARAMETER_VALUE] = _PARAMETER_VALUE
    return schema


# What a value inside ``parameters`` may be, at any depth (oss_api.schemas points to it).
PARAMETER_VALUE = "ParameterValue"
_NO_NUL = {"pattern": r"^[^\x00]*$"}
_ANY_VALUE = {"$ref": f"#/components/schemas/{PARAMETER_VALUE}"}
_PARAMETER_VALUE: dict[str, Any] = {
    "description": "A JSON value with no NUL character in any string or key, at any depth",
    "anyOf": [
        {"type": "string", **_NO_NUL},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "array", "items": _ANY_VALUE},
        {"type": "object", "propertyNames": _NO_NUL, "additionalProperties": _ANY_VALUE},
    ],
}


def without_framework_422(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without the 422 FastAPI adds to each route with parameters (in place; idempotent).

    Routes that can answer 422 declare it with the body they really send
    (:class:`oss_api.errors.Invalid`); FastAPI's HTTPValidationError is never sent.
    """
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            answer = operation.get("responses", {}).get("422", {})
            if answer.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref") == _FRAMEWORK_422:
                del operation["responses"]["422"]
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema
