# Sourced by tools/run_mpi_specs.sh (bin/train's launcher sets the same in
# lua/moonshard/launch.lua): Open MPI settings for one host, as root in CI
# and in containers. Each is a default the caller's environment overrides.
#   - shared memory between ranks of a host (btl self,vader), no network
#     interfaces probed; no single-copy CMA (ptrace is often refused in
#     containers)
#   - no ssh/rsh needed for a local run (plm_rsh_agent=false)
#   - root allowed (CI runs as root)
#   - oversubscription allowed, no binding: more ranks than cores is fine
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader}
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
export OMPI_MCA_plm_rsh_agent=${OMPI_MCA_plm_rsh_agent:-false}
export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
export OMPI_MCA_hwloc_base_binding_policy=${OMPI_MCA_hwloc_base_binding_policy:-none}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
MS_MPIRUN_FLAGS=${MS_MPIRUN_FLAGS:---oversubscribe --bind-to none}
