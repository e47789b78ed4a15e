"""The `edgekv` subcommands, one module each: ``NAME``, ``add(sub)`` (its subparser), ``run(args)``, and where it has
its own checks ``check(args)`` (run after the ``CHECK_AFTER`` stage of ``common.check_common``) and ``prepare(args)``
(run before any check)."""
from edgekv.commands import (
    bench,
    context,
    deploy,
    energy,
    evaluate,
    fpga,
    generate,
    native,
    serve,
    ttft,
)

COMMANDS = (generate, serve, context, ttft, native, deploy, evaluate, bench, energy, fpga)  # in `edgekv --help` order
