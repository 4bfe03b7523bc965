"""The built-in demo workspace: building it (`build`), its scenarios (`scenarios`) and the demo/recent
selections for the run form (`workspace`). May import core.engine, core.checks, core.models,
core.methods, core.numerics, core.capture and core.spec; only core.cli and the dashboard import it."""
