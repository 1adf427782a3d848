"""ftcore's built-in plugins: one folder per kind of component, one module per component.

They register through the same hooks as any third-party plugin; the core lists them by
module path in ``ftcore.plugins.BUILTIN_PLUGINS``. In each folder, modules whose names start
with an underscore are helpers that only that kind uses; ``common/`` holds what several kinds
share. Heavy libraries are imported inside methods, so listing plugins stays fast.
"""
