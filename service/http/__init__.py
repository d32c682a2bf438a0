"""The HTTP program: the Litestar app, its routes, authentication and problem answers."""
