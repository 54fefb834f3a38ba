#!/usr/bin/env bash
# Makes .exp/NAME (a source tree hopper_check.py --trees can load) from NAME.patch, applied with git am onto the
# commit BASE in a throwaway worktree; run from the repository's root:
#   bash docs/history/experiments/materialize.sh exp-sparse-bf16-async 196f988 bf16a
set -euo pipefail
name=${1:?usage: materialize.sh PATCH_NAME BASE [TREE_NAME]} base=${2:?BASE commit} tree=${3:-$1}
wt=$(mktemp -d)
trap 'git worktree remove --force "$wt"' EXIT
git worktree add -q --detach "$wt" "$base"
git -C "$wt" -c user.name=exp -c user.email=exp@localhost am -q "$PWD/docs/history/experiments/$name.patch"
rm -rf ".exp/$tree" && mkdir -p ".exp/$tree"
git -C "$wt" archive HEAD src tests pyproject.toml | tar -x -C ".exp/$tree"
echo ".exp/$tree: $name on $base"
