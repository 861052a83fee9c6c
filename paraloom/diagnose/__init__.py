"""Why a parallel job hangs or breaks: match the ranks' communication and name the culprit.

:mod:`.evidence` loads what a run left (ledgers, heartbeats, statuses); :mod:`.match` lines up
each process group's sequences across ranks; :mod:`.diagnosis` is the result and its wording;
:mod:`.verdict` decides (``ok`` / ``mismatch`` / ``hang`` / ``failed``), names the culprits and
explains; :mod:`.watch` is the live part (a heartbeat per rank, the launcher's "every rank
blocked" test); :mod:`.render` prints it.
"""
