#!/bin/bash
# Unpack the carried .dev/p3 on the lent GPU machine (every measuring call runs it first): textworld's
# planner into /tmp/site, the games into /tmp/data, and, where prepare.sh packed them, the held-out
# games' PDDL->SAS translations into the cache (AGENTRL_CACHE=/tmp/st/cache), so a game's first load
# there costs what a second one does here.
set -e
cd "$(dirname "$0")/../.."
mkdir -p /tmp/site /tmp/data /tmp/st/cache
tar -C /tmp/site -xJf .dev/p3/fast_downward.tar.xz
tar -C /tmp/data -xJf .dev/p3/games.tar.xz
if [ -f .dev/p3/pddl2sas.tar.xz ]; then tar -C /tmp/st/cache -xJf .dev/p3/pddl2sas.tar.xz; fi
