"""Sluice operator: reconciles InferenceModel and Ensemble resources into runtime Deployments."""
