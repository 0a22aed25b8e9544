"""The old name of ``python -m trainer.prepare`` (a command, which lives above the data layer): it says so and
runs it. The data layer itself imports nothing from here."""

if __name__ == "__main__":
    import runpy
    import sys

    print("note: python -m trainer.data.prepare is now python -m trainer.prepare", file=sys.stderr)
    runpy.run_module("trainer.prepare", run_name="__main__", alter_sys=True)
