"""The REST API, its authentication, the admin portal and its static files, and what-if estimates (process
``accelstack-extender``, the main listener)."""
