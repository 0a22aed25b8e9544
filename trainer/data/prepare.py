"""The old name of ``python -m trainer.prepare`` (a command, which lives above the data layer): it runs it.
The data layer itself imports nothing from here."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("trainer.prepare", run_name="__main__", alter_sys=True)
