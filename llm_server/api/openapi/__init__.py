"""The OpenAPI 3.0 document served at /openapi.json (document.py), built from its parts."""
