"""One run, top to bottom: the orchestration above every other part of the package.

    embed.py     the embedding API (`areal_async.train`, `env_workflow`, ...): builds a config and calls `run`
    run.py       `python -m areal_async.run`: prepare, launch, train under supervision, report, tear down
    prepare.py   everything checked and built before launch (`prepare` -> RunPlan)
    connect.py   the controller reaching the trainers, the weight transport and the servers
    rollback.py  the one path that goes backwards: a trainer failure rolls the run back to a checkpoint
    report.py    after the run: summary.json, the plot, the table

Nothing below this package imports it (tests/test_layers.py). The old top-level paths (`areal_async.run`,
`areal_async.embed`) re-export these modules' names. Importing this package imports nothing.
"""
