"""The operator's commands: those that talk to a running gateway over HTTP, ``kvserve experiment
report`` (:mod:`kvserve.deployments.operator.experiment_report`) and ``kvserve warm``
(:mod:`kvserve.deployments.operator.warm`), and ``kvserve serve``'s watch over its own start
(:mod:`kvserve.deployments.operator.startup`)."""
