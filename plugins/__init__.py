"""ftcore's built-in plugins, one module per component.

They register through the same hooks as any third-party plugin; the core lists them
by module path in ``ftcore.plugins.BUILTIN_PLUGINS``. Modules whose names start with an
underscore are shared helpers, not plugins. Heavy libraries are imported inside methods.
"""
