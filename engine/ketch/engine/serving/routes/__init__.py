"""The API server's endpoints, one module each (or one closely related group), each an
``APIRouter`` that ``api_server.create_app`` mounts; they share ``state.ServingState``."""
