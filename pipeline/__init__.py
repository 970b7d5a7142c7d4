"""odb-pipeline: token-budgeted, DGAP-aligned batches streamed to trainer ranks.

Kept free of imports so `import pipeline.<part>` stays cheap (the CLI and trainer_client import
only what they use; Ray, torch and transformers load on demand).
"""

__version__ = "0.1.0"
