"""OCS reconfiguration (pure): validated requests, ordered plans and a timed executor, one module each.

A reconfiguration goes from the current circuits to a target, OCS by OCS, in four ordered steps:

1. move ToR routes off the circuits that will change, wherever another path exists (transition routes);
2. delete the flows of the changed OCS ports: they go dark;
3. ``delay_ms`` after the deletes were *sent*, send the new circuits' flows and wait for a barrier reply from
   every OCS touched;
4. install the final routes computed on the new circuit graph.

Unchanged circuits are never touched. Flow-mods take effect about one install latency after they are sent,
and deletes and adds see the same latency, so the adds are scheduled at ``delete sent + delay`` (not at the
delete's barrier reply + delay), with a precise wait (coarse sleep, then a spin on the clock).

Where each part lives:

* :mod:`controller.reconfig.request`: the REST bodies and the validated :class:`ReconfigRequest`;
* :mod:`controller.reconfig.plan`: :func:`plan_reconfig`, the ordered flow and route changes;
* :mod:`controller.reconfig.executor`: :func:`execute_plan` on a :class:`Driver` (the os-ken app in production,
  a fake flow table in unit tests) and its timestamps;
* :mod:`controller.reconfig.clock`: the injected :class:`Clock` and the controller's :class:`PreciseClock`.

The rule that decides whether to switch at all (slack, predicted gain) is :mod:`controller.switching`, shared
with RLSim and the simulated backend.
"""
